"""Reading cold: what a replay needs so that every read comes from the device, not the cache.

Both replays (a layout's reads on a GGUF, ``layout.replay``; a trace through an expert cache,
``stream.replay``) read cold the same way: O_DIRECT, with every span widened to the device's
alignment (the widened bytes counted), or buffered with the file's pages dropped before every
token and the first drop confirmed with cachestat where the kernel has it.
"""

from __future__ import annotations

import os
import time
from time import perf_counter_ns

import numpy as np

from ..errors import BadInput
from ..pages import drop_cached
from .engine import ReadEngine, get_engine
from .linux import cachestat
from .modes import Mode, OpenFile

NOT_COLD_NOTE = "the page cache still held part of the file after the drop"
"""The note a replay adds when ``drop_and_confirm`` could not confirm the drop."""

DROP_ATTEMPTS = 8
"""Drops tried before a replay says the cache still holds the file, waiting 1, 2, 4 ... ms
between them (about a quarter second in all): pages another CPU has just read may sit in its
per-CPU LRU batch, or still be locked for I/O, for a moment, where a drop cannot reach them."""


def cold_engine(name: str, mode: Mode) -> ReadEngine:
    """The engine ``name`` for a cold replay in ``mode``; ``BadInput`` when the mode cannot
    read cold or the engine cannot run here."""
    if mode is Mode.DONTCACHE:
        raise BadInput("replay reads cold in direct or buffered mode, not dontcache")
    engine = get_engine(name)
    reason = engine.unavailable_reason()
    if reason:
        raise BadInput(f"engine {name!r} cannot run here: {reason}")
    return engine


class ColdStream:
    """Spans per token as an engine workload; drops pages at token boundaries when reading
    buffered (so every token reads cold, as the cost model assumes). The clock starts at the
    first request (``t0_ns``), once the engine has its buffers, as a probe cell's does.
    Requests are numbered 0, 1, ... in issue order; ``latencies`` holds each one's."""

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


def widen_spans(spans: np.ndarray, align: int, size: int) -> np.ndarray:
    """``int64[m, 2]`` (offset, length) spans widened to ``align``-ed starts and ends (the
    last one stops at the file's ``size`` rounded up), as O_DIRECT reads them."""
    if align <= 1 or len(spans) == 0:
        return spans
    start = spans[:, 0] // align * align
    end = np.minimum(-(-(spans[:, 0] + spans[:, 1]) // align) * align, -(-size // align) * align)
    return np.stack([start, end - start], axis=1)


def drop_and_confirm(f: OpenFile, regions: list[tuple[int, int]]) -> bool | None:
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
