"""Physical replay: the reads a layout would issue, issued against the real file, cold.

The check on the cost model. For each token (in trace order) and MoE block, the requests the
cost model merges (``cost.token_requests``) are read from the block's shard at the layout's
offsets, through a read engine at a queue depth, as one stream (the engine keeps the queue
full across tokens, as the surface's cells were measured). Cold means O_DIRECT (spans widened
to the device's alignment, the widened bytes counted), or buffered with the file's pages
dropped before every token and the first drop confirmed with cachestat (where the kernel has
it). Beside the measured time, the prediction for exactly the spans read, from the surface.

Several layouts are replayed *interleaved* (``replay_layouts``): the tokens are cut into
chunks and every layout reads each chunk in turn, the order rotating, so a device whose speed
drifts over a minute slows every layout alike instead of whichever ran during a slow spell.
With ``probe`` the surface itself is measured in the same loop, on the same open file, with the
same engine and queue depth, at the request sizes the replay issues (after widening): cells
between chunks, so the prediction and the measurement see the same device at the same time.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any

import numpy as np

from ..checkpoint.model import MoeModel
from ..errors import BadInput
from ..pages import drop_cached, release_mapped
from ..storage.engine import ReadEngine, get_engine
from ..storage.linux import cachestat
from ..storage.measure import measure_cell
from ..storage.modes import Mode, OpenFile, open_file
from ..storage.surface import Surface, SurfaceCell
from .cost import CostOptions, Misses, block_misses, fit_surface, request_time, token_requests
from .layout import LayoutPlacement


@dataclass
class ReplayResult:
    """What replaying one layout's reads cost on this device."""

    layout: str
    tokens: int
    requests: int
    requested_bytes: int
    device_bytes: int
    seconds: float
    predicted_seconds: float | None
    mode: str
    engine: str
    queue_depth: int
    cold_confirmed: bool | None  # None: the kernel cannot tell (no cachestat)
    notes: list[str] = field(default_factory=list)
    block_seconds: dict[int, float] = field(default_factory=dict)
    """Each block's share of ``seconds``: the wall time split in proportion to the summed
    latencies of the block's requests (exact at queue depth 1, a fair share deeper)."""
    block_predicted: dict[int, float] = field(default_factory=dict)
    """Each block's predicted seconds for the spans read (with a surface)."""
    lengths: np.ndarray | None = field(default=None, repr=False)
    """Every request's length as issued (after O_DIRECT widening), in issue order."""
    latencies_ns: np.ndarray | None = field(default=None, repr=False)
    """Every request's latency, in the same order."""
    chunk_seconds: list[float] = field(default_factory=list)
    """Measured seconds of each chunk of tokens (``replay_layouts`` interleaves by chunk)."""
    chunk_predicted: list[float] = field(default_factory=list)
    """Predicted seconds of each chunk (with a surface)."""

    @property
    def time_per_token(self) -> float:
        return self.seconds / self.tokens if self.tokens else 0.0

    @property
    def predicted_per_token(self) -> float | None:
        if self.predicted_seconds is None or not self.tokens:
            return None
        return self.predicted_seconds / self.tokens

    def block_time_per_token(self, block: int) -> float | None:
        """Measured seconds per token in ``block`` (``None`` when it read nothing)."""
        t = self.block_seconds.get(block)
        return None if t is None or not self.tokens else t / self.tokens

    def to_json(self) -> dict[str, Any]:
        p = self.predicted_per_token
        per = self.tokens or 1
        return {
            "layout": self.layout,
            "tokens": self.tokens,
            "requests": self.requests,
            "requested_bytes": self.requested_bytes,
            "device_bytes": self.device_bytes,
            "measured_us_per_token": self.time_per_token * 1e6,
            "predicted_us_per_token": None if p is None else p * 1e6,
            "mode": self.mode,
            "engine": self.engine,
            "queue_depth": self.queue_depth,
            "cold_confirmed": self.cold_confirmed,
            "notes": list(self.notes),
            "blocks": [
                {
                    "block": b,
                    "measured_us_per_token": t / per * 1e6,
                    "predicted_us_per_token": (
                        self.block_predicted[b] / per * 1e6 if b in self.block_predicted else None
                    ),
                }
                for b, t in sorted(self.block_seconds.items())
            ],
        }


class _Stream:
    """The replay's requests as an engine workload; drops pages at token boundaries when
    reading buffered (so every token reads cold, as the cost model assumes). The clock starts
    at the first request (``t0_ns``), once the engine has its buffers, as a probe cell's does."""

    def __init__(self, f: OpenFile, spans: list[np.ndarray], drop_each_token: bool) -> None:
        self.f = f
        self.spans = spans  # per token: int64[m, 2] (offset, length)
        self.max_length = max((int(s[:, 1].max()) for s in spans if len(s)), default=1)
        self.drop = drop_each_token
        self.bytes = 0
        self.latencies = np.zeros(sum(len(s) for s in spans), dtype=np.int64)
        self.t0_ns: int | None = None
        self._t = 0
        self._i = 0
        self._n = 0

    def next(self) -> tuple[int, int, int] | None:
        if self.t0_ns is None:
            self.t0_ns = perf_counter_ns()
        while self._t < len(self.spans):
            s = self.spans[self._t]
            if self._i < len(s):
                off, n = int(s[self._i, 0]), int(s[self._i, 1])
                self._i += 1
                self._n += 1
                return self._n - 1, off, n
            self._t += 1
            self._i = 0
            if self.drop and self._t < len(self.spans):
                drop_cached(self.f.fd)
        return None

    def complete(self, token: int, data: memoryview, nbytes: int, latency_ns: int) -> None:
        self.bytes += nbytes
        self.latencies[token] = latency_ns


def _widen(spans: np.ndarray, align: int, size: int) -> np.ndarray:
    if align <= 1 or len(spans) == 0:
        return spans
    start = spans[:, 0] // align * align
    end = np.minimum(-(-(spans[:, 0] + spans[:, 1]) // align) * align, -(-size // align) * align)
    return np.stack([start, end - start], axis=1)


@dataclass
class _Reads:
    """One layout's requests, per token in execution order, and which block issued each."""

    placement: LayoutPlacement
    spans: list[np.ndarray]  # per token: int64[m, 2] (offset, length) as requested
    owners: list[np.ndarray]  # per token: int64[m], the block of each request
    requests: int
    requested: int


def _layout_reads(
    placement: LayoutPlacement,
    tokens: int,
    block_map: list[int],
    misses: list[Misses],
    options: CostOptions,
    surface: Surface | None,
) -> _Reads:
    fit = fit_surface(surface, options.queue_depth) if surface else None
    per_block = [
        token_requests(placement.block(b), m.rows, m.experts, options.merge_gap, fit)
        for b, m in zip(block_map, misses, strict=True)
    ]
    tok = np.concatenate([r.token for r in per_block])
    order = np.argsort(tok, kind="stable")  # per token, blocks in execution order
    owner = np.concatenate(
        [np.full(r.token.size, b, np.int64) for r, b in zip(per_block, block_map, strict=True)]
    )[order]
    both = np.stack(
        [
            np.concatenate([r.offset for r in per_block]),
            np.concatenate([r.length for r in per_block]),
        ],
        axis=1,
    )[order]
    cuts = np.searchsorted(tok[order], np.arange(1, tokens))
    return _Reads(
        placement,
        np.split(both, cuts),
        np.split(owner, cuts),
        int(both.shape[0]),
        int(both[:, 1].sum()) if both.size else 0,
    )


@dataclass
class _Tally:
    """What one layout's chunks measured so far."""

    seconds: float = 0.0
    chunk_seconds: list[float] = field(default_factory=list)
    lengths: list[np.ndarray] = field(default_factory=list)
    owners: list[np.ndarray] = field(default_factory=list)
    latencies: list[np.ndarray] = field(default_factory=list)


@dataclass
class _ProbeTally:
    """Probe cells measured between chunks, per request size: each cell's time per request.

    A size's time is the median over its cells (one per chunk), as a layout's measured speedup
    is the median over chunks: a burst of another process's I/O that slows one chunk and the
    cell beside it moves neither."""

    per_request: dict[int, list[float]] = field(default_factory=dict)
    requests: dict[int, int] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)

    def add(self, size: int, seconds: float, requests: int) -> None:
        if requests:
            self.per_request.setdefault(size, []).append(seconds / requests)
        self.requests[size] = self.requests.get(size, 0) + requests
        self.seconds[size] = self.seconds.get(size, 0.0) + seconds

    def surface(self, engine: str, mode: Mode, queue_depth: int, cell_seconds: float) -> Surface:
        cells = [
            SurfaceCell(
                size,
                queue_depth,
                size / statistics.median(times),
                requests=self.requests[size],
                seconds=self.seconds[size],
                repeats=len(times),
            )
            for size, times in sorted(self.per_request.items())
        ]
        return Surface(
            cells,
            engine=engine,
            mode=mode.value,
            cell_seconds=cell_seconds,
            cache_bypassed=mode is Mode.DIRECT,
            note="measured interleaved with a replay, on the model file, at its request sizes "
            "(median of one cell per chunk)",
        )


MAX_PROBE_SIZES = 12
"""Request sizes probed beside a replay: the most frequent ones it issues, and its extremes."""


def probe_sizes(reads: list[np.ndarray], align: int, limit: int = MAX_PROBE_SIZES) -> list[int]:
    """The request sizes worth a cell: the smallest and largest issued, then the most
    frequent, each rounded up to ``align`` (a probe cell reads aligned, whole requests)."""
    lengths = np.concatenate(reads) if reads else np.zeros(0, np.int64)
    if lengths.size == 0:
        return []
    a = max(align, 512)
    sizes, counts = np.unique(-(-lengths // a) * a, return_counts=True)
    chosen = {int(sizes[0]), int(sizes[-1])}
    for i in np.argsort(-counts, kind="stable"):
        if len(chosen) >= limit:
            break
        chosen.add(int(sizes[i]))
    return sorted(chosen)


@dataclass
class ReplaySet:
    """Several layouts replayed interleaved, and the surface probed beside them (if asked)."""

    results: list[ReplayResult]
    surface: Surface | None
    chunks: int

    def result(self, layout: str) -> ReplayResult:
        return next(r for r in self.results if r.layout == layout)

    def measured_speedup(self, layout: str, base: str = "identity") -> float | None:
        """Median over chunks of ``base``'s time over ``layout``'s: each chunk's two readings
        were taken moments apart, so a slow spell of the device cancels out."""
        return _paired(self.result(base).chunk_seconds, self.result(layout).chunk_seconds)

    def predicted_speedup(self, layout: str, base: str = "identity") -> float | None:
        """The same median over chunks, of the predictions."""
        return _paired(self.result(base).chunk_predicted, self.result(layout).chunk_predicted)

    def to_json(self) -> dict[str, Any]:
        return {
            "chunks": self.chunks,
            "surface": self.surface.to_json() if self.surface else None,
            "replays": [r.to_json() for r in self.results],
        }


def replay(
    model: MoeModel,
    placement: LayoutPlacement,
    ids: np.ndarray,
    block_map: list[int],
    options: CostOptions | None = None,
    surface: Surface | None = None,
    engine: str = "pread",
    mode: Mode = Mode.DIRECT,
) -> ReplayResult:
    """Read what ``placement`` needs for ``ids[tokens, layers, k]`` from ``model``'s file."""
    got = replay_layouts(
        model, [placement], ids, block_map, options, surface, engine, mode, chunk_tokens=0
    )
    return got.results[0]


def replay_layouts(
    model: MoeModel,
    placements: list[LayoutPlacement],
    ids: np.ndarray,
    block_map: list[int],
    options: CostOptions | None = None,
    surface: Surface | None = None,
    engine: str = "pread",
    mode: Mode = Mode.DIRECT,
    chunk_tokens: int = 16,
    probe: bool = False,
    probe_seconds: float = 0.01,
    misses: list[Misses] | None = None,
) -> ReplaySet:
    """Replay every placement's reads for ``ids[tokens, layers, k]``, interleaved: chunks of
    ``chunk_tokens`` tokens (0: all at once), each read by every layout in a rotating order.
    With ``probe``, a cell of ``probe_seconds`` at each request size the replays issue is
    measured between chunks and the predictions come from that surface (not ``surface``)."""
    options = options or CostOptions()
    options.check()
    if ids.shape[0] == 0:
        raise BadInput("no tokens to replay (the trace or its chosen range is empty)")
    if mode is Mode.DONTCACHE:
        raise BadInput("replay reads cold in direct or buffered mode, not dontcache")
    if chunk_tokens < 0:
        raise BadInput(f"chunk tokens must be 0 or more, got {chunk_tokens}")
    if not placements:
        raise BadInput("no layouts to replay")
    shards = {p.block(b).shard for p in placements for b in block_map}
    if len(shards) != 1:
        raise BadInput(
            f"replay reads one file; these blocks sit in shards {sorted(shards)}", model.path
        )
    shard = shards.pop()
    eng = get_engine(engine)
    reason = eng.unavailable_reason()
    if reason:
        raise BadInput(f"engine {engine!r} cannot run here: {reason}")
    tokens = ids.shape[0]
    if misses is None:
        misses = block_misses(ids, options.cache)
    reads = [_layout_reads(p, tokens, block_map, misses, options, surface) for p in placements]
    step = chunk_tokens or tokens
    bounds = [(a, min(a + step, tokens)) for a in range(0, tokens, step)]
    tallies = [_Tally() for _ in placements]
    probed = _ProbeTally()
    with open_file(model.shard_paths[shard], mode) as f:
        eng.check(f.mode, options.queue_depth)
        widened = [[_widen(s, f.offset_align, f.size) for s in r.spans] for r in reads]
        sizes = probe_sizes([s[:, 1] for w in widened for s in w], f.offset_align) if probe else []
        # this process's own map of the header (gguf-py) pins pages the kernel will not drop
        release_mapped(getattr(model.shards[shard].reader.data, "_mmap", None), 0, f.size)
        regions = [p.block(b).region for p in placements for b in block_map]
        confirmed = _drop_and_confirm(f, regions)
        for c, (a, z) in enumerate(bounds):
            turn = c % len(placements)
            for i in list(range(turn, len(placements))) + list(range(turn)):
                _run_chunk(
                    f,
                    eng,
                    options.queue_depth,
                    widened[i][a:z],
                    reads[i].owners[a:z],
                    tallies[i],
                    mode,
                )
            for size in sizes if c % 2 == 0 else sizes[::-1]:
                cell = measure_cell(f, eng, size, options.queue_depth, probe_seconds, seed=c)
                probed.add(size, cell.seconds, cell.requests)
    if probe:
        surface = probed.surface(eng.name, mode, options.queue_depth, probe_seconds)
    results = [
        _result(r, t, tokens, block_map, options, surface, eng.name, mode, confirmed)
        for r, t in zip(reads, tallies, strict=True)
    ]
    return ReplaySet(results, surface if probe else None, len(bounds))


def _paired(base: list[float], this: list[float]) -> float | None:
    ratios = [b / t for b, t in zip(base, this, strict=True) if t > 0]
    return statistics.median(ratios) if ratios else None


def _run_chunk(
    f: OpenFile,
    eng: ReadEngine,
    queue_depth: int,
    spans: list[np.ndarray],
    owners: list[np.ndarray],
    tally: _Tally,
    mode: Mode,
) -> None:
    if mode is Mode.BUFFERED:
        drop_cached(f.fd)  # another layout's chunk may have brought these pages in
    work = _Stream(f, spans, drop_each_token=mode is Mode.BUFFERED)
    eng.run(f, work, queue_depth)
    end = perf_counter_ns()
    took = (end - (work.t0_ns or end)) / 1e9
    tally.seconds += took
    tally.chunk_seconds.append(took)
    tally.lengths.append(np.concatenate([s[:, 1] for s in spans]))
    tally.owners.append(np.concatenate(owners))
    tally.latencies.append(work.latencies)


def _result(
    reads: _Reads,
    tally: _Tally,
    tokens: int,
    block_map: list[int],
    options: CostOptions,
    surface: Surface | None,
    engine: str,
    mode: Mode,
    confirmed: bool | None,
) -> ReplayResult:
    lengths = np.concatenate(tally.lengths)
    owner = np.concatenate(tally.owners)
    latencies = np.concatenate(tally.latencies)
    block_predicted: dict[int, float] = {}
    chunk_predicted: list[float] = []
    predicted = None
    if surface is not None:
        for b in block_map:
            block_predicted[b] = request_time(lengths[owner == b], surface, options.queue_depth)
        predicted = sum(block_predicted.values())
        chunk_predicted = [request_time(x, surface, options.queue_depth) for x in tally.lengths]
    notes = []
    if confirmed is False:
        notes.append("the page cache still held part of the file after the drop")
    return ReplayResult(
        reads.placement.name,
        tokens,
        reads.requests,
        reads.requested,
        int(lengths.sum()),
        tally.seconds,
        predicted,
        mode.value,
        engine,
        options.queue_depth,
        confirmed,
        notes,
        _attribute(tally.seconds, latencies, owner, block_map),
        block_predicted,
        lengths,
        latencies,
        tally.chunk_seconds,
        chunk_predicted,
    )


def _attribute(
    seconds: float, latencies: np.ndarray, owner: np.ndarray, block_map: list[int]
) -> dict[int, float]:
    """The wall time split over blocks in proportion to their requests' summed latencies."""
    total = float(latencies.sum())
    if total <= 0:
        return {b: 0.0 for b in block_map}
    return {b: seconds * float(latencies[owner == b].sum()) / total for b in block_map}


DROP_ATTEMPTS = 8
"""Drops tried before the replay says the cache still holds the file, waiting 1, 2, 4 ... ms
between them (about a quarter second in all): pages another CPU has just read may sit in its
per-CPU LRU batch, or still be locked for I/O, for a moment, where a drop cannot reach them."""


def _drop_and_confirm(f: OpenFile, regions: list[tuple[int, int]]) -> bool | None:
    """Drop the file's pages; True when cachestat shows none left in the ``regions`` the
    replay reads, None when the kernel cannot tell."""
    drop_cached(f.fd)
    if f.mode is Mode.DIRECT:
        return True  # O_DIRECT reads never come from the page cache
    try:
        for attempt in range(DROP_ATTEMPTS):
            cs = cachestat(f.fd)
            if cs.nr_dirty or cs.nr_writeback:  # dirty pages cannot be dropped: write back
                os.fdatasync(f.fd)
                drop_cached(f.fd)
            if sum(cachestat(f.fd, a, b - a).nr_cache for a, b in regions) == 0:
                return True
            time.sleep(0.001 * 2**attempt)
            drop_cached(f.fd)
    except OSError:
        return None
    return False
