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
same engine and queue depth: right after each chunk, a *shadow* of it (a random share of every
layout's requests in it, each at its own size after widening, at random aligned offsets in the
blocks' region, one stream per size) is read, and a size's time is the mean over its shadow
reads. The surface is then
weighted by the replay's own mix of sizes and sampled over the same seconds, so a spell of
another process's I/O that slows the replay slows its prediction alike.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any

import numpy as np

from ..checkpoint.model import MoeModel
from ..errors import BadInput
from ..pages import drop_cached, release_mapped
from ..storage.cold import NOT_COLD_NOTE, ColdStream, cold_engine, drop_and_confirm, widen_spans
from ..storage.engine import ReadEngine
from ..storage.modes import Mode, OpenFile, open_file
from ..storage.surface import Surface, SurfaceCell
from .cost import CostOptions, Misses, block_misses, fit_surface, request_time, token_requests
from .layout import LayoutPlacement


@dataclass(kw_only=True)
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
    """Shadow reads measured beside the replay: per request size, their count and seconds
    (each size read as its own stream, so its wall time is its own)."""

    requests: dict[int, int] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)

    def add(self, lengths: np.ndarray, latencies: np.ndarray, wall: float) -> None:
        total = float(latencies.sum())
        if not lengths.size or total <= 0:
            return
        sizes, inverse = np.unique(lengths, return_inverse=True)
        lat = np.bincount(inverse, weights=latencies)
        counts = np.bincount(inverse)
        for size, t, n in zip(sizes.tolist(), lat.tolist(), counts.tolist(), strict=True):
            self.requests[size] = self.requests.get(size, 0) + n
            self.seconds[size] = self.seconds.get(size, 0.0) + wall * t / total

    def surface(self, engine: str, mode: Mode, queue_depth: int) -> Surface:
        cells = [
            SurfaceCell(
                size,
                queue_depth,
                size * n / self.seconds[size],
                requests=n,
                seconds=self.seconds[size],
            )
            for size, n in sorted(self.requests.items())
            if self.seconds[size] > 0
        ]
        if not cells:
            raise BadInput("the probe beside the replay read nothing (no requests to shadow)")
        return Surface(
            cells,
            engine=engine,
            mode=mode.value,
            cache_bypassed=mode is Mode.DIRECT,
            note="measured beside a replay: shadows of its requests at random offsets, each "
            "size's mean",
        )


def _shadow(
    spans: list[np.ndarray], share: float, region: tuple[int, int], align: int, seed: int
) -> np.ndarray:
    """``int64[m, 2]``: a random ``share`` of the requests of ``spans``, each of its own length
    at a random ``align``-ed offset in ``region`` (where it fits), in their order."""
    both = np.concatenate(spans) if spans else np.zeros((0, 2), np.int64)
    rng = np.random.default_rng(seed)
    keep = both[rng.random(len(both)) < share]
    a = max(align, 4096)
    lo = -(-region[0] // a) * a
    room = np.maximum((region[1] - keep[:, 1] - lo) // a, 0)
    offs = lo + (rng.random(len(keep)) * (room + 1)).astype(np.int64) * a
    return np.stack([offs, keep[:, 1]], axis=1)


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


@dataclass(frozen=True)
class MeasureOptions:
    """How a replay reads: the engine and the cold mode, the chunks of tokens the layouts take
    turns on (0: all at once), and the surface probed beside the replay (``probe``: a shadow of
    ``probe_share`` of each layout's requests after every chunk)."""

    engine: str = "pread"
    mode: Mode = Mode.DIRECT
    chunk_tokens: int = 16
    probe: bool = False
    probe_share: float = 0.5

    def check(self) -> None:
        if self.chunk_tokens < 0:
            raise BadInput(f"chunk tokens must be 0 or more, got {self.chunk_tokens}")
        if self.probe and not 0 < self.probe_share <= 1:
            raise BadInput(f"probe share must be above 0 and at most 1, got {self.probe_share}")


def replay(
    model: MoeModel,
    placement: LayoutPlacement,
    ids: np.ndarray,
    block_map: list[int],
    *,
    cost: CostOptions | None = None,
    surface: Surface | None = None,
    engine: str = "pread",
    mode: Mode = Mode.DIRECT,
) -> ReplayResult:
    """Read what ``placement`` needs for ``ids[tokens, layers, k]`` from ``model``'s file."""
    measure = MeasureOptions(engine, mode, chunk_tokens=0)
    got = replay_layouts(
        model, [placement], ids, block_map, cost=cost, surface=surface, measure=measure
    )
    return got.results[0]


def replay_layouts(
    model: MoeModel,
    placements: list[LayoutPlacement],
    ids: np.ndarray,
    block_map: list[int],
    *,
    cost: CostOptions | None = None,
    surface: Surface | None = None,
    measure: MeasureOptions | None = None,
    misses: list[Misses] | None = None,
) -> ReplaySet:
    """Replay every placement's reads for ``ids[tokens, layers, k]``, interleaved: chunks of
    ``measure.chunk_tokens`` tokens, each read by every layout in a rotating order. With
    ``measure.probe`` the predictions come from the surface probed beside the replay (not
    ``surface``). ``misses`` (from ``cost.block_misses``) saves computing them again."""
    options = cost or CostOptions()
    options.check()
    measure = measure or MeasureOptions()
    measure.check()
    engine, mode, probe = measure.engine, measure.mode, measure.probe
    if ids.shape[0] == 0:
        raise BadInput("no tokens to replay (the trace or its chosen range is empty)")
    if not placements:
        raise BadInput("no layouts to replay")
    shards = {p.block(b).shard for p in placements for b in block_map}
    if len(shards) != 1:
        raise BadInput(
            f"replay reads one file; these blocks sit in shards {sorted(shards)}", model.path
        )
    shard = shards.pop()
    eng = cold_engine(engine, mode)
    tokens = ids.shape[0]
    if misses is None:
        misses = block_misses(ids, options.cache)
    reads = [_layout_reads(p, tokens, block_map, misses, options, surface) for p in placements]
    step = measure.chunk_tokens or tokens
    bounds = [(a, min(a + step, tokens)) for a in range(0, tokens, step)]
    tallies = [_Tally() for _ in placements]
    probed = _ProbeTally()
    with open_file(model.shard_paths[shard], mode) as f:
        eng.check(f.mode, options.queue_depth)
        widened = [[widen_spans(s, f.offset_align, f.size) for s in r.spans] for r in reads]
        # this process's own map of the header (gguf-py) pins pages the kernel will not drop
        release_mapped(getattr(model.shards[shard].reader.data, "_mmap", None), 0, f.size)
        regions = [p.block(b).region for p in placements for b in block_map]
        confirmed = drop_and_confirm(f, regions)
        span = (min(r[0] for r in regions), max(r[1] for r in regions))
        shadows: list[np.ndarray] = []
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
                if probe:
                    seed = c * len(placements) + i
                    shadows.append(
                        _shadow(widened[i][a:z], measure.probe_share, span, f.offset_align, seed)
                    )
            if probe:  # the chunk's shadows, every layout's, right after it
                _run_shadow(f, eng, options.queue_depth, np.concatenate(shadows), probed, mode)
                shadows.clear()
    if probe:
        surface = probed.surface(eng.name, mode, options.queue_depth)
    results = [
        _result(r, t, tokens, block_map, options, surface, eng.name, mode, confirmed)
        for r, t in zip(reads, tallies, strict=True)
    ]
    return ReplaySet(results, surface if probe else None, len(bounds))


def _run_shadow(
    f: OpenFile,
    eng: ReadEngine,
    queue_depth: int,
    shadow: np.ndarray,
    probed: _ProbeTally,
    mode: Mode,
) -> None:
    """Read ``shadow`` one request size at a time (as a surface's cells are measured: at a
    queue depth above 1, reads of different sizes in flight together share the device, so one
    mixed stream's wall time cannot be split by size)."""
    sizes, first = np.unique(shadow[:, 1], return_index=True)
    for size in sizes[np.argsort(first)]:
        part = shadow[shadow[:, 1] == size]
        if mode is Mode.BUFFERED:
            drop_cached(f.fd)
        work = ColdStream(f, [part], drop_each_token=False)
        eng.run(f, work, queue_depth)
        end = perf_counter_ns()
        probed.add(part[:, 1], work.latencies, (end - (work.t0_ns or end)) / 1e9)


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
    work = ColdStream(f, spans, drop_each_token=mode is Mode.BUFFERED)
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
        notes.append(NOT_COLD_NOTE)
    return ReplayResult(
        layout=reads.placement.name,
        tokens=tokens,
        requests=reads.requests,
        requested_bytes=reads.requested,
        device_bytes=int(lengths.sum()),
        seconds=tally.seconds,
        predicted_seconds=predicted,
        mode=mode.value,
        engine=engine,
        queue_depth=options.queue_depth,
        cold_confirmed=confirmed,
        notes=notes,
        block_seconds=_attribute(tally.seconds, latencies, owner, block_map),
        block_predicted=block_predicted,
        lengths=lengths,
        latencies_ns=latencies,
        chunk_seconds=tally.chunk_seconds,
        chunk_predicted=chunk_predicted,
    )


def _attribute(
    seconds: float, latencies: np.ndarray, owner: np.ndarray, block_map: list[int]
) -> dict[int, float]:
    """The wall time split over blocks in proportion to their requests' summed latencies."""
    total = float(latencies.sum())
    if total <= 0:
        return {b: 0.0 for b in block_map}
    return {b: seconds * float(latencies[owner == b].sum()) / total for b in block_map}
