"""Runs inside a child process: a routing capture in llama.cpp, spooled to disk as it goes.

The parent (``moepack.llama.runtime.capture``) runs it through ``child.run_worker`` and reads its
events: ``plan`` once the prompts are tokenized and checked, ``tokens`` (``n``) after every
decode call, ``error`` for input llama.cpp cannot take, ``done`` at the end. Routing is appended to
raw spool files after every decode call (ids ``[tokens, layers, k]`` in the trace's id dtype,
router weights float32, token ids int32), so memory never grows with the capture.

An interrupt passed on by the parent (``Channel.stopping``) stops the capture after the
decode call in progress, so the spool always ends on a token boundary, and ``done`` says
``truncated``.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ..prefetcher.evalcb import EvalCallback
from ..protocol.child import Channel, could_not_run, worker_main
from ..protocol.spool import SpoolFiles
from .prompt_tokens import InputError, tokenize_prompts
from .sampling import Sampler
from .session import LlamaSession, SessionParams

TOPK = "ffn_moe_topk"
# The router-weight chain of llama.cpp's build_moe_ffn, in graph order; the last one a layer
# computes is the weight its experts' outputs are scaled by.
WEIGHT_NAMES = (
    "ffn_moe_weights",
    "ffn_moe_weights_softmax",
    "ffn_moe_weights_norm",
    "ffn_moe_weights_scaled",
)


class RoutingSpool:
    """Collects one decode call's routing from the callback and appends it to the spool."""

    def __init__(
        self,
        files: ExitStack,
        folder: Path,
        blocks: list[int],
        k: int,
        id_dtype: str,
        max_tokens: int = 512,
    ) -> None:
        self.blocks = blocks
        self.layer_of = {b: i for i, b in enumerate(blocks)}
        self.k = k
        self.dtype = np.dtype(id_dtype)
        self.files = SpoolFiles(files, folder, ("ids", "weights", "tokens"))
        self.tokens = 0
        self._ids: list[list[np.ndarray]] = [[] for _ in blocks]
        self._w: list[list[np.ndarray | None]] = [[] for _ in blocks]
        # recording only: read ids and final weights together at each layer's expert matmul
        defer = {TOPK: "ids", **{name: "weights" for name in WEIGHT_NAMES}}
        # with the C gate, the reads are made in C into this much room per decode call
        room = 2 * max_tokens * len(blocks) * k * 8 + (1 << 20)
        self.callback = EvalCallback((), self._on_tensor, defer=defer, record_bytes=room)

    @classmethod
    def for_job(
        cls, files: ExitStack, folder: Path, job: dict[str, Any], max_tokens: int
    ) -> RoutingSpool:
        """The spool of a child's job (its ``blocks``, ``k`` and ``id_dtype``)."""
        blocks, k = list(job["blocks"]), int(job["k"])
        return cls(files, folder, blocks, k, job["id_dtype"], max_tokens=max_tokens)

    def _on_tensor(self, name: str, block: int, arr: np.ndarray) -> None:
        layer = self.layer_of.get(block)
        if layer is None:
            raise InputError(
                f"llama.cpp routes experts in block {block}, which the GGUF does not list as "
                f"a MoE block (MoE blocks: {self.blocks})"
            )
        if name == TOPK:
            if arr.shape[-1] != self.k:
                raise InputError(f"block {block} routes top-{arr.shape[-1]}, expected {self.k}")
            self._ids[layer].append(arr.reshape(-1, self.k))
            self._w[layer].append(None)
        elif self._w[layer]:
            self._w[layer][-1] = arr.reshape(-1, self.k)

    def flush(self, tokens: list[int]) -> None:
        """Append the routing of the decode call that fed ``tokens``."""
        self.callback.drain()
        n = len(tokens)
        ids = np.empty((n, len(self.blocks), self.k), dtype=self.dtype)
        w = np.empty((n, len(self.blocks), self.k), dtype="<f4")
        for layer, block in enumerate(self.blocks):
            parts = self._ids[layer]
            got = sum(p.shape[0] for p in parts)
            if got != n:
                raise InputError(
                    f"llama.cpp routed {got} of {n} tokens at block {block} (no routing seen "
                    "there: is it a MoE block llama.cpp runs?)"
                )
            ids[:, layer] = np.concatenate(parts)
            ws = self._w[layer]
            if any(x is None for x in ws):
                raise InputError(f"llama.cpp computed no router weights at block {block}")
            w[:, layer] = np.concatenate([x for x in ws if x is not None])
            parts.clear()
            ws.clear()
        self.files.append(ids=ids, weights=w, tokens=np.asarray(tokens, dtype="<i4"))
        self.tokens += n

    def discard(self) -> None:
        """Forget the routing of a decode call that did not complete."""
        try:
            self.callback.drain()
        except RuntimeError:
            pass
        for parts in self._ids:
            parts.clear()
        for ws in self._w:
            ws.clear()


def run(job: dict[str, Any], channel: Channel) -> dict[str, Any]:
    with ExitStack() as files:
        spool = RoutingSpool.for_job(files, Path(job["spool"]), job, int(job["n_batch"]))
        return capture(job, spool, channel)


def capture(job: dict[str, Any], spool: RoutingSpool, channel: Channel) -> dict[str, Any]:
    """Tokenize and check every prompt, then run them, spooling routing after each call;
    the ``done`` event's fields (``truncated`` when the parent asked to stop)."""
    params = SessionParams(
        n_ctx=int(job["n_ctx"]),
        n_batch=int(job["n_batch"]),
        n_ubatch=int(job["n_ubatch"]),
        threads=int(job["threads"]),
        kv_type=job.get("kv_type", "f32"),
    )
    # the tokenizer first: the context is sized to the longest prompt
    vocab = LlamaSession(job["model"], params, None, vocab_only=True)
    try:
        prompts = tokenize_prompts(vocab, job, params.n_ctx or int(job.get("n_ctx_train", 0)))
    finally:
        vocab.close()
    if not params.n_ctx:
        need = max(len(p) for p in prompts) + job["n_predict"]
        params = replace(params, n_ctx=-(-need // 256) * 256)
    session = LlamaSession(job["model"], params, spool.callback)
    total = sum(len(p) for p in prompts) + job["n_predict"] * len(prompts)
    channel.send("plan", prompts=len(prompts), tokens=total, n_ctx=session.n_ctx)
    sampler = Sampler(job["temp"], job["top_p"], job["seed"])
    segments: list[dict[str, int]] = []
    truncated = False
    try:
        for index, toks in enumerate(prompts):
            if channel.stopping:
                truncated = True
                break
            session.clear()
            start = spool.tokens
            seg = {"prompt": index, "start": start, "prefill": 0, "decode": 0}
            logits = None
            for a in range(0, len(toks), params.n_batch):
                chunk = toks[a : a + params.n_batch]
                # logits for every token: otherwise llama.cpp prunes the last layer's routing
                # to the last token
                logits = session.decode(chunk, a, all_logits=True)
                spool.flush(chunk)
                seg["prefill"] += len(chunk)
                channel.send("tokens", n=len(chunk))
                if channel.stopping:
                    break
            if seg["prefill"] and not channel.stopping:
                pos = len(toks)
                for _ in range(job["n_predict"]):
                    assert logits is not None
                    tok = sampler.sample(logits)
                    if session.is_end(tok):
                        break
                    logits = session.decode([tok], pos, all_logits=True)
                    spool.flush([tok])
                    seg["decode"] += 1
                    pos += 1
                    channel.send("tokens", n=1)
                    if channel.stopping:
                        break
            if seg["prefill"]:
                segments.append(seg)
            if channel.stopping:
                truncated = True
                break
    except RuntimeError as e:
        if not channel.stopping:
            raise could_not_run(str(e), job["model"]) from None
        spool.discard()
        truncated = True
    finally:
        session.close()
    return {"tokens": spool.tokens, "segments": segments, "truncated": truncated}


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:], run))
