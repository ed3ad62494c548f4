"""The cost model: what a token costs in the run ``run`` and ``serve`` will set up, and in
stock llama.cpp's mmap for comparison.

Each estimate follows a ``runchoice.RunChoice`` (the engine, budget, live cache, placement
and threads run's own code chose):

- **llama.cpp's defaults** (the model and its context fit): a token costs its compute
  (``calibrate``, at the placement llama.cpp will use: repacked kernels where it repacks the
  experts, the file's mapping where the model does not fit with room to repack). From a cold
  start (the pages dropped, as ``--verify`` runs it) a model whose experts stay mapped is
  read whole from load on (llama.cpp's ``MADV_WILLNEED``), at the device's large-read
  bandwidth, while the prompt computes.
- **the pager**: the live cache (a per-layer LRU, the size run gives it inside the budget)
  hits at the trace's or the priors' rate, a token misses ``layers x top_k x (1 - hit)``
  experts, and the router lookahead reads ``LOOKAHEAD_WASTE`` more in vain; the pager reads
  them ``O_DIRECT`` at the storage profile's bandwidth for its request size and queue depth,
  beside the compute: ``overlap.overlapped`` (the longer of reads and compute, and what the
  measured overlap share does not hide of the shorter; the bound ``1 / max`` shown beside).
- **the page-cache prefetcher** (where userfaultfd is refused): the same with buffered reads
  and its own, smaller, overlap share.
- **stock llama.cpp's mmap** (``--no-prefetch``, the comparison): every miss a page fault
  priced as the device measured it, counted by replaying the routing through a model of the
  kernel's page cache (``pagecache``), compute and faults in series.

Decode threads are chosen as run's tuner chooses them (``threadtune.ThreadTuner`` fed the
estimated pass times at each count, over the run's passes: its probes are in the run's
average); serve decodes at its one count. Prompts run at the batch threads (every core
unless asked). Prefill: passes of run's ``--batch`` tokens (512), each reading every expert
its tokens chose that the cache does not hold (the first from cold), overlapped with its
compute the same way.

The knee is the smallest ``--memory`` at which run decodes within 10 % of its best (the
model fitting); verdicts are ``fits`` / ``streams`` / ``too slow`` (below ``slow_tps``) /
``refused``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..llama.runtime.threadtune import ThreadTuner
from .calibrate import DEFAULTS, MAPPED, Calibration
from .device import StorageProfile
from .hitrate import HitModel, HitRange
from .overlap import Overlap, overlapped
from .runchoice import RunChoice
from .shapes import ModelShape

QUEUE_DEPTH = 8  # the pager's and the prefetcher's reads in flight (StreamOptions.queue_depth)
UBATCH = 512
SLOW_TPS = 1.0
KNEE_SHARE = 0.9
LOOKAHEAD_WASTE = 0.1
"""The router lookahead's reads in vain, as a share of the demand's misses (measured on a
4-layer model of Qwen3-30B-A3B's layer shape with half its experts in the budget: 29.3 MB
read per token against 26.3 MB of misses, the lookahead's precision 0.48; speculation only
takes room the budget has free, so most of what it would waste is never sent)."""
SEQUENTIAL_READ = 4 << 20  # llama.cpp's load-time read-ahead of a mapped file, per request
DECODE_TOKENS = 16


@dataclass(frozen=True)
class Estimate:
    """One way of running at one memory size: the low end is the pessimistic one."""

    runner: str  # "llama.cpp", "pager", "page cache", "mmap" (stock's own), "refused"
    role: str  # "run", "serve" or "stock"
    decode_tps: tuple[float, float]  # steady state at the chosen threads
    run_decode_tps: tuple[float, float]  # over the run's passes, the tuner's probes included
    prefill_tps: tuple[float, float]
    limiter: str  # "CPU", "disk", "memory" or "-"
    bound_tps: float  # 1 / max(io, compute) at the better end
    compute_s: float  # per decoded token at the chosen threads
    io_s: tuple[float, float]  # per decoded token (at the low and the high end)
    read_per_token: tuple[float, float]  # bytes
    hit: HitRange | None  # the live cache's
    threads: tuple[int, int]  # decode threads chosen (at the low and the high end)
    threads_batch: int
    faults: tuple[float, float] | None = None  # stock: page faults per decoded token
    overlap_share: float | None = None

    @property
    def decode_mid(self) -> float:
        return math.sqrt(self.decode_tps[0] * self.decode_tps[1])

    def to_json(self) -> dict[str, Any]:
        return {
            "runner": self.runner,
            "role": self.role,
            "threads": self.threads[0]
            if self.threads[0] == self.threads[1]
            else list(self.threads),
            "threads_batch": self.threads_batch,
            "decode_tps": {"low": self.decode_tps[0], "high": self.decode_tps[1]},
            "run_decode_tps": {"low": self.run_decode_tps[0], "high": self.run_decode_tps[1]},
            "prefill_tps": {"low": self.prefill_tps[0], "high": self.prefill_tps[1]},
            "limiter": self.limiter,
            "bound_tps": self.bound_tps,
            "compute_ms_per_token": 1e3 * self.compute_s,
            "io_ms_per_token": {"low": 1e3 * self.io_s[0], "high": 1e3 * self.io_s[1]},
            "read_per_token": {"low": self.read_per_token[0], "high": self.read_per_token[1]},
            "hit_rate": self.hit.to_json() if self.hit else None,
            "faults_per_token": (
                {"low": self.faults[0], "high": self.faults[1]} if self.faults else None
            ),
            "overlap_share": self.overlap_share,
        }


@dataclass(frozen=True)
class MemoryPoint:
    """What run, serve and stock llama.cpp do at one memory size (``choice``: run's;
    ``serve_choice``: serve's own, its prefix cache counted; None: run's without the tuner)."""

    choice: RunChoice
    verdict: str
    run: Estimate
    serve: Estimate
    stock: Estimate
    notes: list[str] = field(default_factory=list)
    serve_choice: RunChoice | None = None

    @property
    def served(self) -> RunChoice:
        """What serve runs with here."""
        return self.serve_choice or self.choice

    @property
    def memory(self) -> int:
        """The bytes the whole run may take (``--memory``, or the memory available less the
        margin)."""
        return self.choice.plan.total

    @property
    def fits(self) -> bool:
        return self.choice.engine == "llama.cpp"

    def to_json(self) -> dict[str, Any]:
        return {
            "memory": self.memory,
            "fits": self.fits,
            "verdict": self.verdict,
            "choice": self.choice.to_json(),
            "serve_choice": self.served.to_json(),
            "run": self.run.to_json(),
            "serve": self.serve.to_json(),
            "stock": self.stock.to_json(),
            "notes": self.notes,
        }


def tuned(
    choices: tuple[int, ...], pass_seconds: Callable[[int], float], passes: int
) -> tuple[int, float]:
    """Run's thread tuner fed ``pass_seconds(count)`` for ``passes`` decode passes: the
    count it settles on and the passes' mean tokens/s (its probes included)."""
    tuner = ThreadTuner(choices, lambda _n: None)
    total = 0.0
    for _ in range(max(1, passes)):
        n = tuner.next_threads()
        s = pass_seconds(n)
        tuner.record(s)
        total += s
    return tuner.chosen, max(1, passes) / total


@dataclass
class CostModel:
    shape: ModelShape
    calibration: Calibration
    storage: StorageProfile
    hits: HitModel
    overlap: Overlap
    cores: int
    prompt_tokens: int = 128
    decode_tokens: int = DECODE_TOKENS
    slow_tps: float = SLOW_TPS
    ubatch: int = UBATCH  # run's --batch: the prompt tokens of one llama.cpp pass

    # -- parts ----------------------------------------------------------------------------
    def compute(self, threads: int, placement: str) -> float:
        return self.calibration.decode_seconds(self.shape, threads, placement)

    def prefill_compute(self, threads: int, placement: str) -> float:
        return self.calibration.prefill_seconds(self.shape, threads, placement)

    @property
    def slice_bytes(self) -> int:
        return self.shape.bytes_per_expert // max(1, self.shape.matrices)

    def _ubatches(self) -> list[int]:
        n = self.prompt_tokens
        return [min(self.ubatch, n - i) for i in range(0, n, self.ubatch)]

    def _decode(
        self, tune: tuple[int, int] | None, threads: int, pass_s: Callable[[int], float]
    ) -> tuple[int, float, float]:
        """(threads chosen, steady tokens/s, the run's mean tokens/s)."""
        if tune:
            chosen, mean = tuned(tune, pass_s, self.decode_tokens)
            return chosen, 1 / pass_s(chosen), mean
        return threads, 1 / pass_s(threads), 1 / pass_s(threads)

    # -- the runs ------------------------------------------------------------------------
    def run(self, ch: RunChoice, role: str = "run") -> Estimate:
        """What ``run`` (``role`` run: the tuner where it tunes) or ``serve`` (no tuner)
        gets with ``ch``."""
        tune = ch.tune if role == "run" else None
        if ch.engine == "refused":
            return self._refused(ch, role)
        if ch.engine == "llama.cpp":
            if self.shape.file_bytes > ch.available:  # more --memory than the machine has
                return self._mmap(ch, role, tune, ch.available)
            return self._fitted(ch, role, tune)
        return self._streamed(ch, role, tune)

    def stock(self, ch: RunChoice) -> Estimate:
        """``run --no-prefetch``: llama.cpp's own mmap at the same memory."""
        if ch.plan.fits and self.shape.file_bytes <= ch.available:
            return self._fitted(ch, "stock", ch.tune)
        return self._mmap(ch, "stock", ch.tune, ch.plan.total)

    def _refused(self, ch: RunChoice, role: str) -> Estimate:
        zero = (0.0, 0.0)
        t = (ch.threads, ch.threads)
        return Estimate(
            "refused", role, zero, zero, zero, "memory", 0.0, 0.0, zero, zero, None, t,
            ch.threads_batch,
        )  # fmt: skip

    def _fitted(self, ch: RunChoice, role: str, tune: tuple[int, int] | None) -> Estimate:
        s = self.shape
        placement = ch.placement

        def pass_s(t: int) -> float:
            return self.compute(t, placement)

        chosen, steady, mean = self._decode(tune, ch.threads, pass_s)
        c = pass_s(chosen)
        repacked = placement == DEFAULTS and self.calibration.repacks_experts
        pc = self.prefill_compute(ch.threads_batch, placement)
        seconds = self.prompt_tokens * pc
        if not repacked:
            # from a cold start: llama.cpp asks the kernel for its whole mapping at load
            # (MADV_WILLNEED; measured: a 1.4 GB file cached whole after a 1-token prompt
            # that touched 28 KB of it), read in file order while the prompt computes
            read = s.file_bytes / self.storage.bandwidth(SEQUENTIAL_READ, QUEUE_DEPTH)
            seconds = max(seconds, read)
        pf = self.prompt_tokens / seconds
        return Estimate(
            "llama.cpp", role, (steady, steady), (mean, mean), (pf, pf), "CPU", 1 / c, c,
            (0.0, 0.0), (0.0, 0.0), None, (chosen, chosen), ch.threads_batch,
        )  # fmt: skip

    def _streamed(self, ch: RunChoice, role: str, tune: tuple[int, int] | None) -> Estimate:
        s = self.shape
        engine = ch.engine
        per_layer = max(1, int(s.expert_column_bytes))
        slots = ch.slots or min(s.n_expert, ch.budget // per_layer)
        hit = self.hits.live_cache(slots)
        need = s.active_expert_bytes * (1 + LOOKAHEAD_WASTE)
        reads = (need * (1 - hit.high), need * (1 - hit.low))
        if engine == "pager":
            bw = self.storage.pager_bandwidth(self.slice_bytes, QUEUE_DEPTH)
        else:
            bw = self.storage.bandwidth(self.slice_bytes, QUEUE_DEPTH)
        io = (reads[0] / bw, reads[1] / bw)

        def pass_at(io_s: float) -> Callable[[int], float]:
            def pass_s(t: int) -> float:
                share = self.overlap.share(engine, t >= self.cores)
                return overlapped(io_s, self.compute(t, MAPPED), share)

            return pass_s

        lo_t, lo_steady, lo_mean = self._decode(tune, ch.threads, pass_at(io[1]))
        hi_t, hi_steady, hi_mean = self._decode(tune, ch.threads, pass_at(io[0]))
        c = self.compute(hi_t, MAPPED)
        share = self.overlap.share(engine, hi_t >= self.cores)
        pf = self._streamed_prefill(ch, engine, bw, slots)
        limiter = "memory" if slots < s.top_k else ("disk" if io[0] > c else "CPU")
        return Estimate(
            engine,
            role,
            (lo_steady, hi_steady),
            (lo_mean, hi_mean),
            (pf, pf),
            limiter,
            1 / max(c, io[0]),
            c,
            io,
            reads,
            hit,
            (lo_t, hi_t),
            ch.threads_batch,
            overlap_share=share,
        )

    def _streamed_prefill(self, ch: RunChoice, engine: str, bw: float, slots: int) -> float:
        """Prompt tokens/s: each ubatch reads every expert its tokens chose that the cache
        does not hold (the first from cold: the run starts with the pages dropped), beside
        its compute at the batch threads."""
        s = self.shape
        tb = ch.threads_batch
        pc = self.prefill_compute(tb, MAPPED)
        share = self.overlap.share(engine, tb >= self.cores)
        total = 0.0
        for i, n in enumerate(self._ubatches()):
            t = self.hits.touched(n)
            # an LRU smaller than what a ubatch touches keeps nothing of it for the next (the
            # experts come in the same order every time); a larger one keeps its share
            held = 0.0 if i == 0 or slots < t else slots / max(1, s.n_expert)
            io = t * (1 - held) * s.expert_column_bytes / bw  # the dense weights: at load
            total += overlapped(io, n * pc, share)
        return self.prompt_tokens / total

    def _mmap(
        self, ch: RunChoice, role: str, tune: tuple[int, int] | None, memory: int
    ) -> Estimate:
        """llama.cpp reading through its own mmap, the page cache holding ``memory`` less
        the context, the run and the dense bytes."""
        s = self.shape
        placement = MAPPED  # defaults repack only what fits with room (placement.choose)
        cache = max(0, memory - ch.plan.reserve - s.dense_bytes)
        cell = self.storage.fault(self.slice_bytes)
        window = max(cell.bytes_read, 4096.0)
        few, many = self.hits.page_cache(cache, int(window))
        io = (few * cell.seconds, many * cell.seconds)
        reads = (few * cell.bytes_read, many * cell.bytes_read)

        def pass_at(io_s: float) -> Callable[[int], float]:
            return lambda t: self.compute(t, placement) + io_s  # a fault stops the compute

        lo_t, lo_steady, lo_mean = self._decode(tune, ch.threads, pass_at(io[1]))
        hi_t, hi_steady, hi_mean = self._decode(tune, ch.threads, pass_at(io[0]))
        c = self.compute(hi_t, placement)
        resident = min(1.0, cache / max(1, s.expert_bytes))
        big = self.storage.fault(max(self.slice_bytes, int(window)))
        pc = self.prefill_compute(ch.threads_batch, placement)
        seconds = 0.0
        for i, n in enumerate(self._ubatches()):
            t = self.hits.touched(n)
            held = 0.0 if i == 0 else resident  # a cold start
            pf_bytes = t * s.expert_column_bytes * (1 - held)
            seconds += n * pc + pf_bytes / max(1.0, big.bandwidth)
        pf = self.prompt_tokens / seconds
        return Estimate(
            "mmap", role, (lo_steady, hi_steady), (lo_mean, hi_mean), (pf, pf),
            "disk" if io[0] > c else "CPU", 1 / max(c, io[0]), c, io, reads, None,
            (lo_t, hi_t), ch.threads_batch, (few, many),
        )  # fmt: skip

    # -- one memory size ------------------------------------------------------------------
    def point(self, ch: RunChoice, served: RunChoice | None = None) -> MemoryPoint:
        """Run with ``ch``, serve with ``served`` (None: ``ch`` without the tuner) and stock
        llama.cpp at ``ch``'s memory."""
        run = self.run(ch, "run")
        serve = self.run(served or ch, "serve")
        stock = self.stock(ch)
        if ch.engine == "refused":
            verdict = "refused"
        elif ch.engine == "llama.cpp" and run.runner == "llama.cpp":
            verdict = "fits"
        else:
            verdict = "streams" if run.decode_mid >= self.slow_tps else "too slow"
        return MemoryPoint(ch, verdict, run, serve, stock, serve_choice=served)

    def best_tps(self, ch: RunChoice) -> float:
        """Decode with everything in memory at the best thread count run could use."""
        counts = {ch.threads, *(ch.tune or ())}
        return max(1 / self.compute(t, DEFAULTS) for t in counts)


def knee(model: CostModel, choose: Callable[[int], RunChoice], lo: int, hi: int,
         best: float, points: int = 32) -> dict[str, Any]:  # fmt: skip
    """The smallest ``--memory`` in [lo, hi] at which run decodes within ``KNEE_SHARE`` of
    ``best``, at the low and the high end of the hit rates (``hi`` where none does)."""
    grid = [int(lo * (hi / lo) ** (i / (points - 1))) for i in range(points)] if hi > lo else [hi]
    out: dict[str, Any] = {"best_tps": best, "share": KNEE_SHARE}
    estimates = [(m, model.run(choose(m))) for m in grid]
    for end, idx in (("low", 0), ("high", 1)):
        out[end] = next(
            (
                m
                for m, e in estimates
                if e.runner != "refused" and e.decode_tps[idx] >= KNEE_SHARE * best
            ),
            hi,
        )
    return out


def other_sizes(memory: int, lo: int, hi: int) -> list[int]:
    """Two more ``--memory`` sizes worth seeing: half and twice ``memory``, kept between the
    least the pager runs in (``lo``) and the size the model fits in (``hi``), and apart from
    it."""
    out: list[int] = []
    for m in (memory // 2, memory * 2, (memory + hi) // 2, max(lo, memory * 3 // 4)):
        m = min(max(m, lo), hi)
        if all(abs(m - x) > 0.05 * max(m, x) for x in [memory, *out]):
            out.append(m)
        if len(out) == 2:
            break
    return out
