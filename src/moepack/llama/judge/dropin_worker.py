"""Runs inside a child process: one ``check-dropin`` run of a model over a fixed text.

The text is tokenized, cut into windows of ``window`` tokens (each a fresh sequence starting
at position 0, with the start token llama.cpp itself would add, if any: ``start_token`` asks
its vocabulary, never the metadata, whose BOS id may lie outside the vocabulary), and every
window is decoded with logits for every token. A failed decode names the run and the window. The worker writes ``tokens.bin`` / ``ids.bin`` / ``weights.bin`` (the routing
spool of ``capture_worker``) and ``logits.bin`` (float32 ``[tokens, vocab]``) into its output
folder; its ``done`` event (``child``) says ``tokens``, ``vocab`` and the window lengths.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from ..protocol.child import Channel, could_not_run, worker_main
from ..runtime.capture_worker import InputError, RoutingSpool
from ..runtime.session import LlamaSession, SessionParams


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


def window_sentence(
    label: str, index: int, count: int, text_at: int, body: int, bos: int | None
) -> str:
    """What a failed decode was decoding: which run, which window, which text tokens."""
    first = f"start token {bos}, then " if bos is not None else ""
    return (
        f"{label}, window {index + 1} of {count}: {first}text tokens {text_at}-{text_at + body - 1}"
    )


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
            bos = session.start_token()
            parts = windows(text_tokens, params.n_ctx, bos, int(job["n_tokens"]))
            with open(folder / "logits.bin", "wb") as logits_fh:
                text_at = 0  # where the window's text tokens start in the tokenized text
                for i, w in enumerate(parts):
                    body = len(w) - (1 if bos is not None else 0)
                    session.clear()
                    try:
                        session.decode(w, 0, all_logits=True)
                    except RuntimeError as e:
                        label = str(job.get("label", "check-dropin"))
                        where = window_sentence(label, i, len(parts), text_at, body, bos)
                        raise could_not_run(f"{e} ({where})", job["model"]) from None
                    text_at += body
                    logits = np.ascontiguousarray(session.logits(), dtype="<f4")
                    logits_fh.write(logits.tobytes())
                    spool.flush(w)
            return {
                "tokens": spool.tokens,
                "vocab": session.n_vocab,
                "windows": [len(w) for w in parts],
                "start_token": bos,
            }
        finally:
            session.close()


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:], run))
