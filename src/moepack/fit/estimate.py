"""The cost model: a token's time is its compute plus the reads its misses cost.

Per runner at a memory size ``M`` (bytes the run may use, page cache included):

- **fits** when the file and llama.cpp's own buffers fit in ``M``: a token costs its compute,
  measured by the calibration (``calibrate``), and nothing is read;
- ``run --prefetch``: the dense bytes are pinned and the live cache gets what the prefetcher
  would give it (``M`` less llama.cpp's buffers, the pinned bytes and its margin), split
  evenly over the MoE layers (``stream.budget``). A decoded token misses
  ``layers * top_k * (1 - hit)`` experts (``hitrate``), read at the surface's bandwidth for
  one expert slice at the prefetcher's queue depth. Its time is compute + reads: overlap
  hides less than the bound assumes (``bench_run.py`` measured 0.57 of
  ``1/max(io, compute)`` and close to ``1/(io + compute)``), so the sum is the estimate and
  ``1/max`` the bound;
- stock llama.cpp: the page cache holds ``M`` less buffers and the dense bytes; each miss is
  a fault whose read-around and time were measured per device (``device``), counted by
  replaying the trace through an LRU of fault windows (``hitrate``).

Prefill of a ``prompt_tokens`` prompt: compute per token from the calibration, plus reading
what each 512-token ubatch touches and the cache does not hold.

The knee is the smallest memory at which ``run --prefetch`` decodes within 10 % of its best
(the model fitting); verdicts are ``fits`` / ``streams`` / ``too slow`` (below
``slow_tps``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .calibrate import Calibration
from .device import StorageProfile
from .hitrate import HitModel, HitRange
from .shapes import ModelShape

MARGIN = 96 << 20  # the prefetcher's cache margin (at least; 5 % when that is more)
PROCESS_BYTES = 160 << 20  # llama.cpp, Python and the worker beyond the file and the KV cache
QUEUE_DEPTH = 8  # the prefetcher's reads in flight (StreamOptions.queue_depth)
UBATCH = 512
SLOW_TPS = 1.0
KNEE_SHARE = 0.9


@dataclass(frozen=True)
class Estimate:
    """One runner at one memory size and thread count."""

    runner: str  # "stock" or "prefetch"
    decode_tps: tuple[float, float]  # (low, high)
    prefill_tps: tuple[float, float]
    limiter: str  # "CPU", "disk" or "memory"
    bound_tps: float  # 1 / max(io, compute) at the better end
    compute_s: float  # per decoded token
    io_s: tuple[float, float]  # per decoded token (at the low and the high end)
    read_per_token: tuple[float, float]  # bytes
    hit: HitRange | None  # the live cache's (prefetch)
    threads: int
    faults: tuple[float, float] | None = None  # stock: page faults per decoded token

    @property
    def decode_mid(self) -> float:
        return math.sqrt(self.decode_tps[0] * self.decode_tps[1])

    def to_json(self) -> dict[str, Any]:
        return {
            "runner": self.runner,
            "threads": self.threads,
            "decode_tps": {"low": self.decode_tps[0], "high": self.decode_tps[1]},
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
        }


@dataclass(frozen=True)
class MemoryPoint:
    """Both runners at one memory size, at the thread count that suits each best."""

    memory: int
    fits: bool
    verdict: str
    stock: Estimate
    prefetch: Estimate
    cache_bytes: int  # the live cache's budget (0 when the model fits)
    slots: int  # experts per layer it holds
    settings: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "memory": self.memory,
            "fits": self.fits,
            "verdict": self.verdict,
            "stock": self.stock.to_json(),
            "prefetch": self.prefetch.to_json(),
            "cache_bytes": self.cache_bytes,
            "slots_per_layer": self.slots,
            "settings": self.settings,
        }


@dataclass
class CostModel:
    shape: ModelShape
    calibration: Calibration
    storage: StorageProfile
    hits: HitModel
    prompt_tokens: int = 128
    n_ctx: int = 4096
    slow_tps: float = SLOW_TPS
    margin: int = MARGIN  # what the prefetcher leaves out of its cache
    process_bytes: int = PROCESS_BYTES

    # -- memory ---------------------------------------------------------------------------
    @property
    def overhead(self) -> int:
        """llama.cpp's memory beyond the file: the F16 KV cache at ``n_ctx`` and the rest."""
        s = self.shape
        kv = 2 * s.blocks * s.kv_heads * s.head_dim * self.n_ctx * 2
        compute = 4 * UBATCH * (8 * s.hidden + s.vocab // 8)
        return kv + compute + self.process_bytes

    @property
    def fit_memory(self) -> int:
        """The smallest memory the whole model fits in."""
        return self.shape.file_bytes + self.overhead

    def cache_budget(self, memory: int) -> int:
        """The live cache ``run --prefetch --cache auto`` gives itself in ``memory``."""
        available = memory - self.overhead - self.shape.dense_bytes
        return max(0, available - max(self.margin, available // 20))

    def slots(self, budget: int) -> int:
        s = self.shape
        return min(s.n_expert, budget // max(1, s.moe_layers) // max(1, s.bytes_per_expert))

    @property
    def min_memory(self) -> int:
        """The least memory in which the live cache holds one token's top-k per layer."""
        s = self.shape
        need = s.moe_layers * s.top_k * s.bytes_per_expert
        return min(self.fit_memory, int(self.overhead + s.dense_bytes + need / 0.95 + self.margin))

    # -- runners --------------------------------------------------------------------------
    def _touched(self, tokens: int) -> float:
        """Experts per layer a ubatch of ``tokens`` touches (uniform routing)."""
        s = self.shape
        return s.n_expert * (1 - (1 - s.top_k / s.n_expert) ** tokens)

    def _prefill(self, threads: int, io_per_ubatch: float) -> float:
        n = self.prompt_tokens
        ubatches = math.ceil(n / UBATCH)
        seconds = (
            n * self.calibration.prefill_seconds(self.shape, threads) + ubatches * io_per_ubatch
        )
        return n / seconds

    def fitted(self, runner: str, threads: int) -> Estimate:
        c = self.calibration.decode_seconds(self.shape, threads)
        p = self._prefill(threads, 0.0)
        return Estimate(
            runner, (1 / c, 1 / c), (p, p), "CPU", 1 / c, c, (0.0, 0.0), (0.0, 0.0), None, threads
        )

    def prefetch(self, memory: int, threads: int) -> Estimate:
        s = self.shape
        c = self.calibration.decode_seconds(s, threads)
        budget = self.cache_budget(memory)
        slots = self.slots(budget)
        limiter_memory = slots < s.top_k
        hit = self.hits.live_cache(max(slots, 0) if not limiter_memory else 0)
        slice_bytes = s.bytes_per_expert // max(1, s.matrices)
        bw = self.storage.bandwidth(slice_bytes, QUEUE_DEPTH)
        per_miss = s.bytes_per_expert
        need = s.moe_layers * s.top_k * per_miss
        reads = (need * (1 - hit.high), need * (1 - hit.low))
        io = (reads[0] / bw, reads[1] / bw)
        decode = (1 / (c + io[1]), 1 / (c + io[0]))
        resident = min(1.0, slots / s.n_expert) if not limiter_memory else 0.0
        touched = self._touched(min(self.prompt_tokens, UBATCH))
        pf_io = s.moe_layers * touched * (1 - resident) * per_miss / bw
        pf = self._prefill(threads, pf_io)
        limiter = "memory" if limiter_memory else ("disk" if io[0] > c else "CPU")
        return Estimate(
            "prefetch", decode, (pf, pf), limiter, 1 / max(c, io[0]), c, io, reads, hit, threads
        )

    def stock(self, memory: int, threads: int) -> Estimate:
        s = self.shape
        c = self.calibration.decode_seconds(s, threads)
        cache = max(0, memory - self.overhead - s.dense_bytes)
        slice_bytes = s.bytes_per_expert // max(1, s.matrices)
        cell = self.storage.fault(slice_bytes)
        window = max(cell.bytes_read, 4096.0)
        few, many = self.hits.page_cache(cache, int(window))
        io = (few * cell.seconds, many * cell.seconds)
        reads = (few * cell.bytes_read, many * cell.bytes_read)
        decode = (1 / (c + io[1]), 1 / (c + io[0]))
        resident = min(1.0, cache / max(1, s.expert_bytes))
        touched = self._touched(min(self.prompt_tokens, UBATCH))
        pf_bytes = s.moe_layers * touched * s.bytes_per_expert * (1 - resident)
        big = self.storage.fault(max(slice_bytes, int(window)))
        pf = self._prefill(threads, pf_bytes / max(1.0, big.bandwidth))
        limiter = "disk" if io[0] > c else "CPU"
        return Estimate(
            "stock",
            decode,
            (pf, pf),
            limiter,
            1 / max(c, io[0]),
            c,
            io,
            reads,
            None,
            threads,
            (few, many),
        )

    # -- one memory size ------------------------------------------------------------------
    def point(self, memory: int, threads: list[int]) -> MemoryPoint:
        """Both runners at ``memory``, each at its best of ``threads``."""
        fits = memory >= self.fit_memory
        if fits:
            stock = max((self.fitted("stock", t) for t in threads), key=lambda e: e.decode_mid)
            pre = self.fitted("prefetch", stock.threads)
            budget, slots = 0, self.shape.n_expert
        else:
            stock = max((self.stock(memory, t) for t in threads), key=lambda e: e.decode_mid)
            pre = max((self.prefetch(memory, t) for t in threads), key=lambda e: e.decode_mid)
            budget = self.cache_budget(memory)
            slots = self.slots(budget)
        if fits:
            verdict = "fits"
        else:
            verdict = (
                "streams" if max(pre.decode_mid, stock.decode_mid) >= self.slow_tps else "too slow"
            )
        settings: dict[str, Any] = {"threads": pre.threads}
        if fits:
            settings.update(prefetch="not needed (the model fits)", cache="auto", pin_dense="auto")
        else:
            settings.update(
                prefetch=True, cache=budget if slots >= self.shape.top_k else None, pin_dense="on"
            )
        return MemoryPoint(memory, fits, verdict, stock, pre, budget, slots, settings)

    def knee(self, threads: list[int], points: int = 32) -> dict[str, Any]:
        """The smallest memory within ``KNEE_SHARE`` of ``run --prefetch``'s best decode, at
        the low and the high end of the hit rates."""
        lo, hi = self.min_memory, self.fit_memory
        grid = (
            [int(lo * (hi / lo) ** (i / (points - 1))) for i in range(points)] if hi > lo else [hi]
        )
        best_t = max(threads, key=lambda t: 1 / self.calibration.decode_seconds(self.shape, t))
        best = 1 / self.calibration.decode_seconds(self.shape, best_t)
        out: dict[str, Any] = {"best_tps": best, "share": KNEE_SHARE}
        for end, idx in (("low", 0), ("high", 1)):
            knee = hi
            for m in grid:
                e = self.prefetch(m, best_t)
                if e.limiter != "memory" and e.decode_tps[idx] >= KNEE_SHARE * best:
                    knee = m
                    break
            out[end] = knee
        return out


def other_sizes(memory: int, model: CostModel) -> list[int]:
    """Two more memory sizes worth seeing: half and twice ``memory``, kept between the
    least the live cache can run in and the size the model fits in, and apart from it."""
    lo, hi = model.min_memory, model.fit_memory
    out: list[int] = []
    for m in (memory // 2, memory * 2, (memory + hi) // 2, max(lo, memory * 3 // 4)):
        m = min(max(m, lo), hi)
        if all(abs(m - x) > 0.05 * max(m, x) for x in [memory, *out]):
            out.append(m)
        if len(out) == 2:
            break
    return out
