"""The cost of a layout for a workload: reads per token and MoE block, and their time.

Per token and block, the chosen experts' slices under the layout (``BlockPlacement.extents``)
are sorted by offset and adjacent ones merged into one request. With ``merge_gap = N`` a gap of
at most N slices is read through as well, but only when that is cheaper: with a surface, when
the gap costs less than one request (gap < t_op · B of the surface's fit); without one, always
up to N slices. With ``cache = N`` each block keeps an LRU of N experts (the registry's
``lru``, as ``replay`` runs it) and only misses are read (0 = every read cold). With a
``Surface``, each request costs ``size / bandwidth(size, queue depth)`` at its own size; without one, only requests and bytes are compared (``time`` is
``None``), and the result says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import BadInput
from ..storage.surface import Surface
from ..trace.cache_policy import POLICIES
from .layout import BlockPlacement, LayoutPlacement

NO_SURFACE_NOTE = "no surface: only requests and bytes are compared, not read time"


@dataclass(frozen=True)
class CostOptions:
    """How reads are issued: read-through of small gaps, an expert cache, the queue depth."""

    merge_gap: int = 0  # read through gaps of up to this many slices
    cache: int = 0  # LRU experts kept per block (0: every read is cold)
    queue_depth: int = 1
    align: int = 0  # O_DIRECT: each request widened to this alignment, as it is issued

    def check(self) -> None:
        if self.merge_gap < 0:
            raise BadInput(f"`merge_gap` must be 0 or more slices, got {self.merge_gap}")
        if self.cache < 0:
            raise BadInput(f"`cache` must be 0 or more experts, got {self.cache}")
        if self.queue_depth < 1:
            raise BadInput(f"queue depth must be at least 1, got {self.queue_depth}")
        if self.align < 0:
            raise BadInput(f"alignment must be 0 or more bytes, got {self.align}")


@dataclass(frozen=True)
class SurfaceFit:
    """``time = requests · t_op + bytes / bandwidth`` fitted to a surface at one queue depth:
    the per-request cost and the streaming bandwidth a user's device shows."""

    t_op: float  # seconds per request
    bandwidth: float  # bytes per second
    queue_depth: int

    def time(self, requests: float, nbytes: float) -> float:
        return requests * self.t_op + nbytes / self.bandwidth

    def to_json(self) -> dict[str, Any]:
        return {
            "t_op_us": self.t_op * 1e6,
            "bandwidth_gbps": self.bandwidth / 1e9,
            "queue_depth": self.queue_depth,
        }


def fit_surface(surface: Surface, queue_depth: int) -> SurfaceFit:
    """Least squares of per-request time over the surface's request sizes, in relative error
    (so small and large requests weigh alike); t_op is clipped at 0."""
    sizes = np.asarray(surface.request_sizes, dtype=np.float64)
    t = np.asarray([s / surface.bandwidth(s, queue_depth) for s in sizes])
    if len(sizes) < 2:
        return SurfaceFit(0.0, float(sizes[0] / t[0]), queue_depth)
    a = np.stack([np.ones_like(sizes), sizes], axis=1) / t[:, None]
    (lat, inv_bw), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if lat < 0 or inv_bw <= 0:
        inv_bw = float(np.sum(sizes * t / t**2) / np.sum(sizes**2 / t**2))
        lat = 0.0
    return SurfaceFit(float(lat), float(1.0 / inv_bw), queue_depth)


@dataclass
class BlockCost:
    """One block's reads over the costed tokens."""

    block: int
    tokens: int
    requests: int
    bytes: int
    time: float | None  # seconds, None without a surface
    lookups: int = 0
    hits: int = 0

    @property
    def requests_per_token(self) -> float:
        return self.requests / self.tokens if self.tokens else 0.0

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / self.tokens if self.tokens else 0.0

    @property
    def time_per_token(self) -> float | None:
        if self.time is None:
            return None
        return self.time / self.tokens if self.tokens else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def to_json(self) -> dict[str, Any]:
        t = self.time_per_token
        return {
            "block": self.block,
            "tokens": self.tokens,
            "requests_per_token": self.requests_per_token,
            "bytes_per_token": self.bytes_per_token,
            "time_per_token_us": None if t is None else t * 1e6,
            "cache_hit_rate": self.hit_rate,
        }


@dataclass
class LayoutCost:
    """Every block's cost under one layout, and the totals per token."""

    layout: str
    blocks: list[BlockCost]
    options: CostOptions
    fit: SurfaceFit | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return self.blocks[0].tokens if self.blocks else 0

    @property
    def requests_per_token(self) -> float:
        return sum(b.requests_per_token for b in self.blocks)

    @property
    def bytes_per_token(self) -> float:
        return sum(b.bytes_per_token for b in self.blocks)

    @property
    def time_per_token(self) -> float | None:
        times = [b.time_per_token for b in self.blocks]
        return None if any(t is None for t in times) else sum(t for t in times if t is not None)

    def block(self, index: int) -> BlockCost:
        return next(b for b in self.blocks if b.block == index)

    def to_json(self) -> dict[str, Any]:
        t = self.time_per_token
        return {
            "layout": self.layout,
            "tokens": self.tokens,
            "merge_gap": self.options.merge_gap,
            "cache": self.options.cache,
            "queue_depth": self.options.queue_depth,
            "align": self.options.align,
            "requests_per_token": self.requests_per_token,
            "bytes_per_token": self.bytes_per_token,
            "time_per_token_us": None if t is None else t * 1e6,
            "fit": self.fit.to_json() if self.fit else None,
            "notes": list(self.notes),
            "blocks": [b.to_json() for b in self.blocks],
        }


@dataclass(frozen=True)
class Requests:
    """The merged requests of some tokens: each one's token, offset and length."""

    token: np.ndarray
    offset: np.ndarray
    length: np.ndarray


def token_requests(
    bp: BlockPlacement,
    rows: np.ndarray,
    experts: np.ndarray,
    merge_gap: int = 0,
    fit: SurfaceFit | None = None,
) -> Requests:
    """The requests that read ``experts[i]`` for token ``rows[i]`` under ``bp``, merged."""
    rows = np.asarray(rows, dtype=np.int64)
    experts = np.asarray(experts, dtype=np.int64)
    if rows.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Requests(empty, empty, empty)
    offs = np.concatenate([t.offsets[experts] for t in bp.tensors])
    lens = np.concatenate([np.full(len(experts), t.slice_bytes, np.int64) for t in bp.tensors])
    tok = np.tile(rows, len(bp.tensors))
    order = np.lexsort((offs, tok))
    offs, lens, tok = offs[order], lens[order], tok[order]
    gap = np.empty_like(offs)
    gap[0] = -1
    gap[1:] = offs[1:] - (offs[:-1] + lens[:-1])
    same = np.zeros(len(offs), dtype=bool)
    same[1:] = tok[1:] == tok[:-1]
    limit = merge_gap * min(t.slice_bytes for t in bp.tensors)
    if fit is not None:
        limit = min(limit, int(fit.t_op * fit.bandwidth))
    merged = same & (gap >= 0) & (gap <= limit)
    first = np.flatnonzero(~merged)
    # a run's span: from its first slice to the furthest end (slices are sorted by offset)
    run_end = np.maximum.reduceat(offs + lens, first)
    return Requests(tok[first], offs[first], run_end - offs[first])


def widened(req: Requests, align: int) -> Requests:
    """``req`` as O_DIRECT issues them: each span widened out to multiples of ``align`` (the
    device reads, and the surface times, the widened size)."""
    if align <= 1 or req.offset.size == 0:
        return req
    start = req.offset // align * align
    end = -(-(req.offset + req.length) // align) * align
    return Requests(req.token, start, end - start)


def request_time(lengths: np.ndarray, surface: Surface, queue_depth: int) -> float:
    """Seconds for these requests: each at its own size's bandwidth at ``queue_depth``."""
    if lengths.size == 0:
        return 0.0
    sizes, counts = np.unique(lengths, return_counts=True)
    per = np.asarray([s / surface.bandwidth(float(s), queue_depth) for s in sizes])
    return float(np.sum(per * counts))


@dataclass(frozen=True)
class Misses:
    """One block's reads after its expert cache: ``experts[i]`` is read for token ``rows[i]``.

    The same for every layout (a layout moves bytes, not which experts a token needs), so it is
    computed once per block and trace and shared by every layout's cost and replay."""

    rows: np.ndarray
    experts: np.ndarray
    hits: int
    lookups: int


def block_misses(ids: np.ndarray, cache: int) -> list[Misses]:
    """Per trace layer of ``ids[tokens, layers, k]``, the reads an LRU of ``cache`` experts
    leaves (0: every chosen expert is read)."""
    out = []
    for layer in range(ids.shape[1]):
        rows, experts, hits = cache_misses(ids[:, layer, :], cache)
        out.append(Misses(rows, experts, hits, int(ids[:, layer, :].size)))
    return out


def cache_misses(ids: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``(rows, experts)`` that miss an LRU of ``capacity`` experts (the registry's ``lru``, as
    ``replay`` runs it), and the hit count. A token's experts are looked up in the cache as the
    earlier tokens left it, then all loaded: a runtime loads a token's experts together, so one
    of them never evicts another before it is used."""
    t, k = ids.shape
    if capacity <= 0:
        return np.repeat(np.arange(t), k), ids.reshape(-1).astype(np.int64), 0
    stream = np.asarray(ids, dtype=np.int64)
    n_expert = int(stream.max()) + 1 if stream.size else 1
    cache = POLICIES.get("lru").new_cache(capacity, n_expert, stream, None)
    rows: list[int] = []
    experts: list[int] = []
    hits = 0
    for r, chosen in enumerate(stream.tolist()):
        for e in chosen:
            if e in cache:
                hits += 1
            else:
                rows.append(r)
                experts.append(e)
        for e in chosen:  # the token's experts are resident once it ran
            cache.access(e)
    return np.asarray(rows, np.int64), np.asarray(experts, np.int64), hits


def block_cost(
    bp: BlockPlacement,
    ids: np.ndarray,
    options: CostOptions,
    surface: Surface | None = None,
    fit: SurfaceFit | None = None,
    misses: Misses | None = None,
) -> BlockCost:
    """One block's cost for ``ids[tokens, k]`` (the block's expert choices); ``misses``, when
    given, are the reads left after the cache (``block_misses``), shared across layouts."""
    if misses is None:
        rows, experts, hits = cache_misses(ids, options.cache)
        misses = Misses(rows, experts, hits, int(ids.size))
    req = widened(
        token_requests(bp, misses.rows, misses.experts, options.merge_gap, fit), options.align
    )
    time = request_time(req.length, surface, options.queue_depth) if surface else None
    return BlockCost(
        bp.block,
        int(ids.shape[0]),
        int(req.length.size),
        int(req.length.sum()),
        time,
        misses.lookups,
        misses.hits,
    )


def layout_cost(
    placement: LayoutPlacement,
    ids: np.ndarray,
    block_map: list[int],
    options: CostOptions = CostOptions(),
    surface: Surface | None = None,
    misses: list[Misses] | None = None,
) -> LayoutCost:
    """The cost of ``placement`` for ``ids[tokens, layers, k]`` (trace layer ``i`` is block
    ``block_map[i]``); ``misses`` (``block_misses(ids, options.cache)``) lets several layouts
    share one pass of the cache over the trace."""
    options.check()
    if ids.shape[0] == 0:
        raise BadInput("no tokens to cost (the trace or its chosen range is empty)")
    if misses is not None and len(misses) != len(block_map):
        raise ValueError("misses must hold one entry per trace layer")
    fit = fit_surface(surface, options.queue_depth) if surface else None
    blocks = [
        block_cost(
            placement.block(b),
            ids[:, layer, :],
            options,
            surface,
            fit,
            None if misses is None else misses[layer],
        )
        for layer, b in enumerate(block_map)
    ]
    notes = [] if surface else [NO_SURFACE_NOTE]
    return LayoutCost(placement.name, blocks, options, fit, notes)
