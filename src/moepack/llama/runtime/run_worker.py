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
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter, perf_counter_ns
from typing import Any

import numpy as np

from ...checkpoint.model import MoeModel, find_shards
from ...errors import BadInput
from ..prefetcher.evalcb import EvalCallback
from ..prefetcher.mapping import evict, no_readaround
from ..prefetcher.prefetch import ExpertRanges
from ..prefetcher.streamer import ExpertStreamer, StreamOptions
from ..protocol.child import Channel, could_not_run, worker_main
from ..protocol.spool import SpoolFiles
from .draft import DraftOptions
from .drafting import AdaptiveLength, DraftRecord, ModelDrafter, PromptLookup, make_drafter
from .identity import FileIdentity, check_unchanged
from .placement import plan_placement, prefetch_unless_idle
from .prompt_tokens import tokenize_prompts
from .session import LlamaSession, SessionParams
from .threadtune import ThreadTuner
from .weights import WeightReport, probe

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


Snapshot = tuple[dict[str, int], dict[str, float], int]
"""(this process's counters, the prefetcher's counters, a perf_counter_ns time)."""


@dataclass
class PhaseMeter:
    """One phase's time, counters and prefetch work, summed over the prompts."""

    ns: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    prefetch: dict[str, float] = field(default_factory=dict)
    draft: DraftRecord = field(default_factory=DraftRecord)

    def add(self, start: Snapshot, end: Snapshot) -> None:
        """Add the phase that ran between two snapshots."""
        (c0, s0, t0), (c1, s1, t1) = start, end
        self.ns += t1 - t0
        for k, v in c1.items():
            self.counters[k] = self.counters.get(k, 0) + v - c0.get(k, 0)
        for name, value in s1.items():
            self.prefetch[name] = self.prefetch.get(name, 0.0) + value - s0.get(name, 0.0)

    def to_json(self, tokens: int) -> dict[str, Any]:
        return {
            "tokens": tokens,
            "seconds": self.ns / 1e9,
            "counters": self.counters,
            "prefetch": self.prefetch,
            "draft": self.draft.to_json(),
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
        self.streamer: ExpertStreamer | None = None
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
            experts = frozenset(t.name for b in model.blocks for t in b.tensors)
        prefetch = prefetch_unless_idle(self.path, cfg["placement"], cfg["prefetch"], channel.warn)
        self.gate: EvalCallback | None = None
        if prefetch is not None:
            options = StreamOptions(**prefetch)
            trace_ids = _lookahead_ids(cfg.get("lookahead_trace"))
            self.streamer = ExpertStreamer(
                self.path, options, lookahead_ids=trace_ids, warn=channel.warn
            )
            files.callback(self.streamer.close)
            self.streamer.on_choice = self._on_choice if cfg["trace"] else None
            self.gate = self.streamer.callback
        elif cfg["trace"]:
            self.gate = EvalCallback([TOPK], lambda _name, layer, ids: self._on_choice(layer, ids))
        self.session: LlamaSession | None = None
        params = SessionParams(
            n_ctx=cfg["n_ctx"],
            n_batch=cfg["batch"],
            n_ubatch=cfg["batch"],
            threads=cfg["threads"],
            kv_type="f16",
            pool_threads=max(cfg["tune_threads"]) if cfg.get("tune_threads") else None,
            threads_batch=cfg.get("threads_batch"),
        )
        placement = plan_placement(self.path, cfg["placement"], streaming=prefetch is not None)
        self.session = LlamaSession(self.path, params, self.gate, placement=placement)
        self.weights = WeightReport(
            placement.to_json(),
            probe(self.session.model.model, self.shards),
            experts,
            self.session.anon_after_load,
            self.session.anon_before_load,
        )
        if self.streamer is not None and self.weights.experts_unmapped:
            unmapped = self.weights.experts_unmapped
            channel.warn(
                f"placement {placement.name}: llama.cpp copied {len(unmapped)} expert tensors "
                f"out of the file's mapping at load ({unmapped[0]}, …): the prefetcher cannot "
                "stream them (placement auto or experts-mapped keeps them mapped)"
            )
        self.tuner: ThreadTuner | None = None
        if cfg.get("tune_threads") and self.session is not None:
            self.tuner = ThreadTuner(cfg["tune_threads"], self.session.set_decode_threads)
        draft = cfg.get("draft")
        self.draft = DraftOptions(**draft) if draft else DraftOptions()
        self.drafter: PromptLookup | ModelDrafter | None = None
        self.lengths: AdaptiveLength | None = None
        if self.draft.enabled:
            self.drafter = make_drafter(self.draft, params)
            files.callback(self.drafter.close)
            self.lengths = AdaptiveLength(self.draft.length, self.draft.adaptive)
        if self.streamer is not None:
            faulting = [
                cfg["threads"],
                cfg.get("threads_batch") or 1,
                *(cfg.get("tune_threads") or ()),
            ]
            copied = [n for n, site in self.weights.sites.items() if not site.mapped]
            self.streamer.attach(threads=max(faulting), copied=copied)
        self.readaround_bytes = 0
        readaround = cfg["readaround"]
        if readaround == "off" or (readaround == "auto" and self._reads_ahead(prefetch)):
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
                    f"`n_predict` ({cfg['n_predict']})",
                    self.path,
                )
        self.logits: list[np.ndarray] = []

    def _reads_ahead(self, prefetch: dict[str, Any] | None) -> bool:
        """Whether the prefetcher reads every chosen expert ahead of its fault (overlap mode
        with the live cache or the pager managing the experts): only then is the kernel's
        read-around redundant. When the model fits and the live cache is off, a page the
        kernel evicted anyway comes back by fault, and without read-around one 4 KiB page
        at a time (measured: 3,056 major faults per token)."""
        if prefetch is None or prefetch.get("mode", "overlap") != "overlap":
            return False
        s = self.streamer
        return s is not None and (bool(s.cache_slots) or s.pager is not None)

    def _check_identity(self) -> None:
        check_unchanged(self.shards, self.identities)

    def _on_choice(self, layer: int, ids: np.ndarray) -> None:
        self._step[layer] = ids

    def _decode(self, tokens: list[int], pos: int, rows: bool = False) -> np.ndarray:
        """Feed ``tokens``; the last one's logits (every token's, ``[n, vocab]``, with
        ``rows``). While tracing, every token's logits are asked for, so that llama.cpp
        routes every token at every layer (it prunes the last layer to the tokens whose
        outputs are used); the routing is spooled by ``_spool``, which a caller that keeps
        only some of the tokens (a verification) calls itself."""
        assert self.session is not None
        tracing = bool(self.cfg["trace"])
        if self.streamer is not None and not tracing:
            # nothing can miss when the whole file is cached: such a pass runs without the
            # callback (no graph splits, no Python calls)
            self.streamer.before_pass()
        try:
            self.session.decode(tokens, pos, all_logits=tracing or rows)
        except RuntimeError as e:
            raise could_not_run(str(e), self.path) from None
        if self.streamer is not None:
            self.streamer.after_pass()
        self._check_identity()
        logits = self.session.logits()
        if not rows:
            self._spool(len(tokens))
            return logits[-1]
        return logits

    def _spool(self, keep: int) -> None:
        """Spool the routing of the last pass's first ``keep`` tokens (tracing only)."""
        if self.spool is not None:
            ids = np.stack([self._step[b][:keep] for b in self.moe_blocks], axis=1)
            self.spool.append(ids=ids.astype(self.id_dtype))
            self.routed += ids.shape[0]
            self._step.clear()

    def _measure(self) -> Snapshot:
        stats = self.streamer.snapshot() if self.streamer else {}
        return counters(), stats, perf_counter_ns()

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
            "threads_batch": self.cfg.get("threads_batch") or self.cfg["threads"],
            "thread_tuning": self.tuner.report() if self.tuner else None,
            "stream": self.streamer.report() if self.streamer else None,
            "weights": self.weights.to_json(),
            "no_readaround_bytes": self.readaround_bytes,
            "cached_after_evict": cached_after_evict,
            "prefill": prefill.to_json(prompt_tokens),
            "decode": decode.to_json(generated_tokens),
        }

    def _one_prompt(
        self, index: int, tokens: list[int], prefill: PhaseMeter, decode: PhaseMeter
    ) -> tuple[list[int], int | None]:
        """Prefill ``tokens`` and generate after them; (generated ids, pages left by a cold start)."""
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
            if self.streamer is not None:
                self.streamer.cold_start()
        m1 = self._measure()
        prefill.add(m0, m1)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        generated: list[int] = []
        vocab = self.session.model.vocab

        def emit(token: int, chose: np.ndarray) -> None:
            if cfg["logits_out"]:
                self.logits.append(chose)
            generated.append(token)
            piece = decoder.decode(token_bytes(vocab, token))
            if piece:
                self.channel.send("piece", piece=piece, prompt=index)

        if self.drafter is not None:
            logits = self._drafted(tokens, logits, emit, generated, decode)
        else:
            logits = self._one_by_one(len(tokens), logits, emit, generated)
        tail = decoder.decode(b"", final=True)
        if tail:
            self.channel.send("piece", piece=tail, prompt=index)
        decode.add(m1, self._measure())
        if cfg["logits_out"]:
            self.logits.append(logits)
        return generated, cached_after_evict

    def _choose(self, step: int, logits: np.ndarray) -> int | None:
        """The token after ``logits`` at decode step ``step`` (None: the model ended)."""
        assert self.session is not None
        if self.forced:
            return self.forced[step]
        token = int(np.argmax(logits))
        return None if self.session.is_end(token) else token

    def _one_by_one(
        self,
        pos: int,
        logits: np.ndarray,
        emit: Callable[[int, np.ndarray], None],
        generated: list[int],
    ) -> np.ndarray:
        """Greedy decoding, one token a pass; the logits after the last token."""
        for step in range(self.cfg["n_predict"]):
            if self.channel.stopping:
                self.truncated = True
                break
            token = self._choose(step, logits)
            if token is None:  # the model ended: the logits that chose its end come last
                break
            emit(token, logits)
            if self.tuner is not None:
                self.tuner.next_threads()
                t0 = perf_counter()
                logits = self._decode([token], pos)
                self.tuner.record(perf_counter() - t0)
            else:
                logits = self._decode([token], pos)
            pos += 1
        return logits

    def _drafted(
        self,
        prompt: list[int],
        logits: np.ndarray,
        emit: Callable[[int, np.ndarray], None],
        generated: list[int],
        meter: PhaseMeter,
    ) -> np.ndarray:
        """Greedy decoding with drafts verified in one pass each: a pass feeds the token
        just chosen and ``k`` drafted after it, and keeps the drafts up to the first the
        model would not have chosen (then its choice there is the next token): the tokens
        are the ones decoding one by one chooses. The logits after the last token kept."""
        assert self.session is not None and self.drafter is not None
        assert self.lengths is not None
        record = meter.draft
        n = self.cfg["n_predict"]
        context = list(prompt)
        pos = len(prompt)
        step = 0
        self.drafter.reset()
        while step < n:
            if self.channel.stopping:
                self.truncated = True
                break
            token = self._choose(step, logits)
            if token is None:
                break
            emit(token, logits)
            step += 1
            context.append(token)
            k = self.lengths.length(n - step)
            t0 = perf_counter_ns()
            drafts = self.drafter.draft(context, k) if k else []
            t1 = perf_counter_ns()
            batch = [token, *drafts]
            u0 = self.streamer.batch_counts() if self.streamer is not None else (0, 0)
            rows = np.atleast_2d(self._decode(batch, pos, rows=bool(drafts)))
            t2 = perf_counter_ns()
            u1 = self.streamer.batch_counts() if self.streamer is not None else (0, 0)
            self.lengths.observe_pass(len(batch), (t2 - t1) / 1e9)
            kept = 0
            while kept < len(drafts) and step < n:
                want = self._choose(step, rows[kept])
                if want is None or want != drafts[kept]:
                    break
                emit(want, rows[kept])
                step += 1
                context.append(want)
                kept += 1
            if drafts:
                self._spool(1 + kept)
            pos += 1 + kept
            if kept < len(drafts):
                self.session.forget_from(pos)  # the rejected drafts' KV entries
            logits = rows[kept]
            record.lengths[len(drafts)] = record.lengths.get(len(drafts), 0) + 1
            if drafts:
                self.lengths.observe_draft(len(drafts), kept, (t1 - t0) / 1e9)
                record.verify_passes += 1
                record.drafted += len(drafts)
                record.accepted += kept
                record.verify_seconds += (t2 - t1) / 1e9
                record.draft_seconds += (t1 - t0) / 1e9
                record.verify_union_experts += u1[0] - u0[0]
                record.verify_routed += u1[1] - u0[1]
            else:
                record.single_passes += 1
                record.single_seconds += (t2 - t1) / 1e9
                record.draft_seconds += (t1 - t0) / 1e9
                record.single_union_experts += u1[0] - u0[0]
                record.single_routed += u1[1] - u0[1]
        return logits

    def close(self) -> None:
        if self.streamer is not None:  # the file back in place before llama.cpp unmaps it
            self.streamer.release_pager()
        if self.session is not None:
            self.session.close()


def _lookahead_ids(path: str | None) -> np.ndarray | None:
    """The ids of a trace given to fit the lookahead's trace-learned predictors."""
    if not path:
        return None
    from ...trace.formats import load_trace

    return np.asarray(load_trace(path).ids)


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
