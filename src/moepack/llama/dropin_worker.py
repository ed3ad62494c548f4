"""Runs inside a child process: one ``check-dropin`` run of a model over a fixed text.

The text is tokenized, cut into windows of ``window`` tokens (each a fresh sequence starting
at position 0, BOS first when the model adds one), and every window is decoded with logits for
every token. The worker writes ``tokens.bin`` / ``ids.bin`` / ``weights.bin`` (the routing
spool of ``capture_worker``) and ``logits.bin`` (float32 ``[tokens, vocab]``) into its output
folder; its ``done`` event (``child``) says ``tokens``, ``vocab`` and the window lengths.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from .capture_worker import InputError, RoutingSpool
from .child import Channel, could_not_run, worker_main
from .session import LlamaSession, SessionParams


def windows(tokens: list[int], window: int, bos: int | None, n_tokens: int) -> list[list[int]]:
    """``n_tokens`` tokens of ``tokens`` as windows of ``window`` (BOS first when given)."""
    body = window - (1 if bos is not None else 0)
    out: list[list[int]] = []
    total = 0
    for a in range(0, len(tokens), body):
        if total >= n_tokens:
            break
        w = ([bos] if bos is not None else []) + tokens[a : a + body]
        w = w[: n_tokens - total]
        if len(w) < 2:
            break
        out.append(w)
        total += len(w)
    if total < n_tokens:
        raise InputError(f"the text gives {total} tokens, {n_tokens} are needed")
    return out


def run(job: dict[str, Any], channel: Channel) -> dict[str, Any]:
    """Decode the job's text window by window, spooling logits and routing."""
    folder = Path(job["out"])
    params = SessionParams(
        n_ctx=int(job["window"]),
        n_batch=int(job["window"]),
        n_ubatch=int(job["window"]),
        threads=int(job["threads"]),
        kv_type=job["kv_type"],
    )
    with ExitStack() as files:
        spool = RoutingSpool.for_job(files, folder, job, int(job["window"]))
        session = LlamaSession(job["model"], params, spool.callback)
        try:
            text_tokens = session.tokenize(job["text"], add_special=False)
            meta = session.metadata()
            add_bos = meta.get("tokenizer.ggml.add_bos_token", "true") != "false"
            bos_id = meta.get("tokenizer.ggml.bos_token_id")
            bos = int(bos_id) if add_bos and bos_id is not None else None
            parts = windows(text_tokens, params.n_ctx, bos, int(job["n_tokens"]))
            with open(folder / "logits.bin", "wb") as logits_fh:
                for w in parts:
                    session.clear()
                    try:
                        session.decode(w, 0, all_logits=True)
                    except RuntimeError as e:
                        raise could_not_run(str(e), job["model"]) from None
                    logits = np.ascontiguousarray(session.logits(), dtype="<f4")
                    logits_fh.write(logits.tobytes())
                    spool.flush(w)
            return {
                "tokens": spool.tokens,
                "vocab": session.n_vocab,
                "windows": [len(w) for w in parts],
            }
        finally:
            session.close()


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:], run))
