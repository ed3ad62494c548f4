"""Physical replay: the reads a layout would issue, issued against the real file, cold.

The check on the cost model. For each token (in trace order) and MoE block, the requests the
cost model merges (``cost.token_requests``) are read from the block's shard at the layout's
offsets, through a read engine at a queue depth, as one stream (the engine keeps the queue
full across tokens, as the surface's cells were measured). Cold means O_DIRECT (spans widened
to the device's alignment, the widened bytes counted), or buffered with the file's pages
dropped before every token and the first drop confirmed with cachestat (where the kernel has
it). Beside the measured time, the prediction for exactly the spans read, from the surface.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any

import numpy as np

from ..checkpoint.model import MoeModel
from ..errors import BadInput
from ..pages import drop_cached, release_mapped
from ..storage.engine import get_engine
from ..storage.linux import cachestat
from ..storage.modes import Mode, OpenFile, open_file
from ..storage.surface import Surface
from .cost import CostOptions, cache_misses, fit_surface, request_time, token_requests
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

    @property
    def time_per_token(self) -> float:
        return self.seconds / self.tokens if self.tokens else 0.0

    @property
    def predicted_per_token(self) -> float | None:
        if self.predicted_seconds is None or not self.tokens:
            return None
        return self.predicted_seconds / self.tokens

    def to_json(self) -> dict[str, Any]:
        p = self.predicted_per_token
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
        }


class _Stream:
    """The replay's requests as an engine workload; drops pages at token boundaries when
    reading buffered (so every token reads cold, as the cost model assumes)."""

    def __init__(self, f: OpenFile, spans: list[np.ndarray], drop_each_token: bool) -> None:
        self.f = f
        self.spans = spans  # per token: int64[m, 2] (offset, length)
        self.max_length = max((int(s[:, 1].max()) for s in spans if len(s)), default=1)
        self.drop = drop_each_token
        self.bytes = 0
        self._t = 0
        self._i = 0
        self._n = 0

    def next(self) -> tuple[int, int, int] | None:
        while self._t < len(self.spans):
            s = self.spans[self._t]
            if self._i < len(s):
                off, n = int(s[self._i, 0]), int(s[self._i, 1])
                self._i += 1
                self._n += 1
                return self._n, off, n
            self._t += 1
            self._i = 0
            if self.drop and self._t < len(self.spans):
                drop_cached(self.f.fd)
        return None

    def complete(self, token: int, data: memoryview, nbytes: int, latency_ns: int) -> None:
        self.bytes += nbytes


def _widen(spans: np.ndarray, align: int, size: int) -> np.ndarray:
    if align <= 1 or len(spans) == 0:
        return spans
    start = spans[:, 0] // align * align
    end = np.minimum(-(-(spans[:, 0] + spans[:, 1]) // align) * align, -(-size // align) * align)
    return np.stack([start, end - start], axis=1)


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
    options = options or CostOptions()
    options.check()
    if ids.shape[0] == 0:
        raise BadInput("no tokens to replay (the trace or its chosen range is empty)")
    if mode is Mode.DONTCACHE:
        raise BadInput("replay reads cold in direct or buffered mode, not dontcache")
    shards = {placement.block(b).shard for b in block_map}
    if len(shards) != 1:
        raise BadInput(
            f"replay reads one file; these blocks sit in shards {sorted(shards)}", model.path
        )
    shard = shards.pop()
    eng = get_engine(engine)
    reason = eng.unavailable_reason()
    if reason:
        raise BadInput(f"engine {engine!r} cannot run here: {reason}")
    fit = fit_surface(surface, options.queue_depth) if surface else None
    per_block = []
    for layer, b in enumerate(block_map):
        rows, experts, _hits = cache_misses(ids[:, layer, :], options.cache)
        per_block.append(token_requests(placement.block(b), rows, experts, options.merge_gap, fit))
    requested = sum(int(r.length.sum()) for r in per_block)
    n_req = sum(int(r.length.size) for r in per_block)
    with open_file(model.shard_paths[shard], mode) as f:
        eng.check(f.mode, options.queue_depth)
        tokens = ids.shape[0]
        tok = np.concatenate([r.token for r in per_block])
        order = np.argsort(tok, kind="stable")  # per token, blocks in execution order
        both = np.stack(
            [
                np.concatenate([r.offset for r in per_block]),
                np.concatenate([r.length for r in per_block]),
            ],
            axis=1,
        )[order]
        cuts = np.searchsorted(tok[order], np.arange(1, tokens))
        spans = [_widen(s, f.offset_align, f.size) for s in np.split(both, cuts)]
        device_bytes = int(sum(int(s[:, 1].sum()) for s in spans))
        # this process's own map of the header (gguf-py) pins pages the kernel will not drop
        release_mapped(getattr(model.shards[shard].reader.data, "_mmap", None), 0, f.size)
        regions = [placement.block(b).region for b in block_map]
        confirmed = _drop_and_confirm(f, regions)
        work = _Stream(f, spans, drop_each_token=mode is Mode.BUFFERED)
        t0 = perf_counter_ns()
        eng.run(f, work, options.queue_depth)
        seconds = (perf_counter_ns() - t0) / 1e9
    predicted = None
    notes: list[str] = []
    if surface is not None:
        lengths = np.concatenate([s[:, 1] for s in spans])
        predicted = request_time(lengths, surface, options.queue_depth)
    if confirmed is False:
        notes.append("the page cache still held part of the file after the drop")
    return ReplayResult(
        placement.name,
        tokens,
        n_req,
        requested,
        device_bytes,
        seconds,
        predicted,
        mode.value,
        eng.name,
        options.queue_depth,
        confirmed,
        notes,
    )


def _drop_and_confirm(f: OpenFile, regions: list[tuple[int, int]]) -> bool | None:
    """Drop the file's pages; True when cachestat shows none left in the ``regions`` the
    replay reads, None when the kernel cannot tell."""
    drop_cached(f.fd)
    if f.mode is Mode.DIRECT:
        return True  # O_DIRECT reads never come from the page cache
    try:
        cs = cachestat(f.fd)
        if cs.nr_dirty or cs.nr_writeback:  # dirty pages cannot be dropped: write them back
            os.fdatasync(f.fd)
            drop_cached(f.fd)
        left = sum(cachestat(f.fd, a, b - a).nr_cache for a, b in regions)
    except OSError:
        return None
    return left == 0
