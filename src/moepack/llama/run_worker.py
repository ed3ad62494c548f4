"""Runs inside a child process: greedy generation in llama.cpp for each prompt in order,
optionally with the expert prefetcher in the eval callback, measured per phase (prefill,
decode; summed over the prompts). With a trace asked for, each decode call's routing is
appended to a spool file (``spool.SpoolFiles``), so memory does not grow with the tokens.

The parent (``run.run_model``) runs it through ``child.run_worker``: events ``warning``,
``piece`` (``piece``, ``prompt``) per generated token, then ``done`` with the measurements.
An interrupt passed on by the parent stops generation after the decode call in progress
(``done`` then says ``truncated``).
"""

from __future__ import annotations

import codecs
import ctypes
import resource
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from time import perf_counter_ns
from typing import Any

import numpy as np

from ..checkpoint.model import MoeModel, find_shards
from ..errors import BadInput
from .child import Channel, could_not_run, worker_main
from .evalcb import EvalCallback
from .identity import FileIdentity, check_unchanged
from .mapping import evict, no_readaround
from .prefetch import ExpertRanges, Prefetcher, PrefetchStats, ResidencySwitch
from .prompt_tokens import tokenize_prompts
from .session import LlamaSession, SessionParams
from .spool import SpoolFiles

TOPK = "ffn_moe_topk"


def counters() -> dict[str, int]:
    """This process's fault, I/O and CPU counters (all threads): getrusage and /proc/self/io."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out = {
        "major_faults": int(ru.ru_majflt),
        "minor_faults": int(ru.ru_minflt),
        "cpu_ns": int((ru.ru_utime + ru.ru_stime) * 1e9),
    }
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("read_bytes", "syscr", "rchar"):
                out[key] = int(value)
    except OSError:
        pass
    return out


@dataclass
class PhaseMeter:
    """One phase's time, counters and prefetch work, summed over the prompts."""

    ns: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    prefetch: dict[str, float] = field(default_factory=dict)

    def add(
        self,
        start: tuple[dict[str, int], PrefetchStats, int],
        end: tuple[dict[str, int], PrefetchStats, int],
    ) -> None:
        (c0, s0, t0), (c1, s1, t1) = start, end
        self.ns += t1 - t0
        for k, v in c1.items():
            self.counters[k] = self.counters.get(k, 0) + v - c0.get(k, 0)
        a, b = s1.to_json(), s0.to_json()
        for k in a:
            self.prefetch[k] = self.prefetch.get(k, 0) + a[k] - b[k]

    def to_json(self, tokens: int) -> dict[str, Any]:
        return {
            "tokens": tokens,
            "seconds": self.ns / 1e9,
            "counters": self.counters,
            "prefetch": self.prefetch,
        }


def token_bytes(vocab: Any, token: int) -> bytes:
    """The bytes llama.cpp renders for ``token`` (special tokens as nothing)."""
    import llama_cpp

    buf = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, False)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, False)
    return buf.raw[: max(n, 0)]


class Generation:
    """One model loaded with one context; greedy decoding with per-phase measurements."""

    def __init__(self, job: dict[str, Any], channel: Channel, files: ExitStack) -> None:
        cfg = {**job, **job["options"]}
        self.cfg = cfg
        self.channel = channel
        self.truncated = False
        self.path = cfg["model"]
        self.identities = [FileIdentity(*i) for i in cfg["identities"]]
        self.shards = find_shards(Path(self.path))
        self._check_identity()
        self.prefetcher: Prefetcher | None = None
        self._step: dict[int, np.ndarray] = {}  # layer -> ids of the current decode call
        self.spool: SpoolFiles | None = None
        if cfg["trace"]:
            self.spool = SpoolFiles(files, Path(cfg["spool"]), ("ids",))
            self.id_dtype = np.dtype(cfg["id_dtype"])
        self.routed = 0  # tokens whose routing is spooled
        with MoeModel(self.path) as model:  # closed before llama.cpp maps the file
            layout = ExpertRanges(model)
            self.expert_ranges = [r for b in layout.blocks for r in layout.whole_tensors(b)]
            self.moe_blocks = layout.blocks
            if cfg["prefetch"] is not None:
                pf = cfg["prefetch"]
                self.prefetcher = Prefetcher(model, pf["engine"], pf["queue_depth"])
        self.switch = ResidencySwitch(self.prefetcher) if self.prefetcher else None
        if self.prefetcher is not None and self.prefetcher.warning:
            channel.warn(self.prefetcher.warning)
        self.gate: EvalCallback | None = None
        if cfg["prefetch"] is not None or cfg["trace"]:
            self.gate = EvalCallback([TOPK], self._on_topk)
        self.session: LlamaSession | None = None
        params = SessionParams(
            n_ctx=cfg["n_ctx"],
            n_batch=cfg["batch"],
            n_ubatch=cfg["batch"],
            threads=cfg["threads"],
            kv_type="f16",
        )
        self.session = LlamaSession(self.path, params, self.gate)
        self.readaround_bytes = 0
        if cfg["no_readaround"]:
            self.readaround_bytes = no_readaround(self.shards, self.expert_ranges)
        # the context must hold each prompt, its generated tokens and one more
        self.prompts = tokenize_prompts(self.session, cfg, self.session.n_ctx - 1)
        # A given continuation is decoded token by token instead of generated (the benchmark's
        # decode then routes like the text it was written from, not like greedy output).
        self.forced: list[int] = []
        if cfg.get("continuation"):
            self.forced = self.session.tokenize(cfg["continuation"], add_special=False)
            if len(self.forced) < cfg["n_predict"]:
                raise BadInput(
                    f"the continuation has {len(self.forced)} tokens, fewer than "
                    f"n_predict ({cfg['n_predict']})",
                    self.path,
                )
        self.logits: list[np.ndarray] = []

    def _check_identity(self) -> None:
        check_unchanged(self.shards, self.identities)

    def _on_topk(self, name: str, layer: int, ids: np.ndarray) -> None:
        if self.prefetcher is not None:
            self.prefetcher.prefetch(layer, np.unique(ids).tolist())
        if self.cfg["trace"]:
            self._step[layer] = ids

    def _decode(self, tokens: list[int], pos: int) -> np.ndarray:
        """Feed ``tokens``; the last one's logits. While tracing, every token's logits are
        asked for, so that llama.cpp routes every token at every layer (it prunes the last
        layer to the tokens whose outputs are used)."""
        assert self.session is not None
        tracing = bool(self.cfg["trace"])
        if self.gate is not None and self.switch is not None and not tracing:
            # Nothing can miss when the whole file is cached: run this pass without the
            # callback (no graph splits, no Python calls).
            self.gate.enabled = self.switch.callback_needed()
        try:
            logits = np.atleast_2d(self.session.decode(tokens, pos, all_logits=tracing))[-1]
        except RuntimeError as e:
            raise could_not_run(str(e), self.path) from None
        self._check_identity()
        if self.spool is not None:
            ids = np.stack([self._step[b] for b in self.moe_blocks], axis=1)
            self.spool.append(ids=ids.astype(self.id_dtype))
            self.routed += ids.shape[0]
            self._step.clear()
        return logits

    def _measure(self) -> tuple[dict[str, int], PrefetchStats, int]:
        stats = self.prefetcher.stats if self.prefetcher else PrefetchStats()
        return counters(), replace(stats), perf_counter_ns()

    def run(self) -> dict[str, Any]:
        """Every prompt in order, each from an empty context: prefill, then decode."""
        prefill, decode = PhaseMeter(), PhaseMeter()
        runs: list[dict[str, Any]] = []
        segments: list[dict[str, int]] = []
        cached_after_evict = None
        for index, tokens in enumerate(self.prompts):
            if self.channel.stopping:
                self.truncated = True
                break
            start = sum(s["prefill"] + s["decode"] for s in segments)
            generated, cached = self._one_prompt(index, tokens, prefill, decode)
            cached_after_evict = cached if cached is not None else cached_after_evict
            runs.append({"prompt_tokens": len(tokens), "generated": generated})
            segments.append(
                {"prompt": index, "start": start, "prefill": len(tokens), "decode": len(generated)}
            )
        if self.cfg["logits_out"] and not self.truncated:
            np.save(self.cfg["logits_out"], np.stack(self.logits).astype(np.float32))
        choice = self.prefetcher.choice if self.prefetcher else None
        prompt_tokens = sum(r["prompt_tokens"] for r in runs)
        generated_tokens = sum(len(r["generated"]) for r in runs)
        return {
            "prompts": runs,
            "segments": segments,
            "truncated": self.truncated,
            "routed_tokens": self.routed,
            "prompt_tokens": prompt_tokens,
            "generated": [t for r in runs for t in r["generated"]],
            "moe_blocks": self.moe_blocks,
            "callback": self.gate.kind if self.gate else None,
            "threads": self.cfg["threads"],
            "engine": choice.engine if choice else None,
            "queue_depth": choice.queue_depth if choice else None,
            "no_readaround_bytes": self.readaround_bytes,
            "cached_after_evict": cached_after_evict,
            "prefill": prefill.to_json(prompt_tokens),
            "decode": decode.to_json(generated_tokens),
        }

    def _one_prompt(
        self, index: int, tokens: list[int], prefill: PhaseMeter, decode: PhaseMeter
    ) -> tuple[list[int], int | None]:
        """Prefill ``tokens`` and generate after them; (generated ids, pages left by --cold)."""
        cfg = self.cfg
        assert self.session is not None
        self.session.clear()
        batch = cfg["batch"]
        m0 = self._measure()
        logits = np.zeros(0, dtype=np.float32)
        for start in range(0, len(tokens), batch):
            logits = self._decode(tokens[start : start + batch], start)
        cached_after_evict = None
        if cfg["cold"]:
            cached_after_evict = evict(self.shards)
            if self.switch is not None:
                self.switch.reset()
        m1 = self._measure()
        prefill.add(m0, m1)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        generated: list[int] = []
        pos = len(tokens)
        forced = self.forced
        for step in range(cfg["n_predict"]):
            if self.channel.stopping:
                self.truncated = True
                break
            if cfg["logits_out"]:
                self.logits.append(logits)
            token = forced[step] if forced else int(np.argmax(logits))
            if not forced and self.session.is_end(token):
                break
            generated.append(token)
            piece = decoder.decode(token_bytes(self.session.model.vocab, token))
            if piece:
                self.channel.send("piece", piece=piece, prompt=index)
            logits = self._decode([token], pos)
            pos += 1
        tail = decoder.decode(b"", final=True)
        if tail:
            self.channel.send("piece", piece=tail, prompt=index)
        decode.add(m1, self._measure())
        if cfg["logits_out"]:
            self.logits.append(logits)
        return generated, cached_after_evict

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
        if self.prefetcher is not None:
            self.prefetcher.close()


def generate(job: dict[str, Any], channel: Channel) -> dict[str, Any]:
    gen: Generation | None = None
    with ExitStack() as files:
        try:
            gen = Generation(job, channel, files)
            return gen.run()
        finally:
            if gen is not None:
                gen.close()


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:], generate))
