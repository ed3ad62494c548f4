"""One measurement cell: an engine, a mode, a request size and a queue depth, time-bounded.

Each cell starts cold: the file's pages are dropped (POSIX_FADV_DONTNEED) and the residency
is checked with cachestat before and after. Offsets are aligned to the request size and
drawn as a random permutation, so within a cell no block is read twice and a buffered read
can never be served by a page an earlier read of the same cell brought in. In O_DIRECT mode
(no cache) the permutation is simply redrawn when the file is used up; in the cached modes
the cell ends there instead, and says so.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from time import perf_counter_ns

import numpy as np

from ..errors import BadInput
from .engine import ReadEngine
from .linux import PAGE_SIZE, CacheStat, cachestat, drop_cache
from .modes import Mode, OpenFile


@dataclass
class CellResult:
    """What one cell measured."""

    engine: str
    mode: str
    request_bytes: int
    queue_depth: int
    seconds: float
    requests: int
    bytes: int
    bytes_per_sec: float
    iops: float
    lat_p50_us: float
    lat_p99_us: float
    lat_mean_us: float
    cpu_seconds: float
    cpu_sec_per_gb: float
    cache_pages_before: int | None  # file pages in the page cache after the drop
    cache_pages_after: int | None  # ... and when the cell ended
    evicted_pages: int | None  # file pages the kernel evicted under pressure during the cell
    recently_evicted_pages: int | None
    exhausted: bool  # the cell read the whole file before its time was up

    @property
    def gbps(self) -> float:
        return self.bytes_per_sec / 1e9

    @property
    def residency(self) -> float | None:
        """Share of the bytes this cell read that the page cache still holds afterwards."""
        if self.cache_pages_after is None or self.cache_pages_before is None or not self.bytes:
            return None
        gained = max(0, self.cache_pages_after - self.cache_pages_before) * PAGE_SIZE
        return min(1.0, gained / self.bytes)


class _RandomWork:
    """Random request-aligned offsets until the deadline (or one pass, in cached modes)."""

    def __init__(
        self,
        file_size: int,
        request_bytes: int,
        deadline_ns: int,
        wrap: bool,
        seed: int,
        min_requests: int = 0,
    ) -> None:
        self.max_length = request_bytes
        self._slots = file_size // request_bytes
        self._rng = np.random.default_rng(seed)
        self._offsets = self._draw()
        self._i = 0
        self._deadline = deadline_ns
        self._wrap = wrap
        self._min = min_requests
        self.issued = 0
        self.exhausted = False
        self.latencies: list[int] = []
        self.bytes = 0

    def _draw(self) -> list[int]:
        return (self._rng.permutation(self._slots) * self.max_length).tolist()

    def next(self) -> tuple[int, int, int] | None:
        if self.issued >= self._min and perf_counter_ns() >= self._deadline:
            return None
        if self._i >= len(self._offsets):
            self.exhausted = True
            if not self._wrap:
                return None
            self._offsets = self._draw()
            self._i = 0
        off = self._offsets[self._i]
        self._i += 1
        self.issued += 1
        return 0, off, self.max_length

    def complete(self, token: int, data: memoryview, nbytes: int, latency_ns: int) -> None:
        self.latencies.append(latency_ns)
        self.bytes += nbytes


def _cachestat(fd: int) -> CacheStat | None:
    try:
        return cachestat(fd)
    except OSError:
        return None


def _make_cold(f: OpenFile) -> CacheStat | None:
    """Drop the file's pages; dirty pages cannot be dropped, so write them back first."""
    drop_cache(f.fd)
    cs = _cachestat(f.fd)
    if cs is not None and (cs.nr_dirty or cs.nr_writeback):
        os.fdatasync(f.fd)
        drop_cache(f.fd)
        cs = _cachestat(f.fd)
    return cs


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def measure_cell(
    f: OpenFile,
    engine: ReadEngine,
    request_bytes: int,
    queue_depth: int,
    seconds: float,
    seed: int = 0,
) -> CellResult:
    """Run ``engine`` on ``f`` with random reads of ``request_bytes`` for about ``seconds``
    (longer when the queue is so deep and the requests so large that twice the queue depth
    of requests has not been issued by then)."""
    engine.check(f.mode, queue_depth)
    if request_bytes % f.offset_align:
        raise BadInput(
            f"request size {request_bytes} is not a multiple of the O_DIRECT alignment "
            f"({f.offset_align} bytes)",
            f.path,
        )
    if f.size < request_bytes:
        raise BadInput(
            f"file holds {f.size:,} bytes, less than one request of {request_bytes:,}", f.path
        )
    before = _make_cold(f)
    cpu0 = _cpu()
    t0 = perf_counter_ns()
    work = _RandomWork(
        f.size,
        request_bytes,
        t0 + int(seconds * 1e9),
        wrap=f.mode is Mode.DIRECT,
        seed=seed,
        min_requests=2 * queue_depth,  # at least one refill of the whole queue, however slow
    )
    engine.run(f, work, queue_depth)
    elapsed = (perf_counter_ns() - t0) / 1e9
    cpu = _cpu() - cpu0
    after = _cachestat(f.fd)
    lat = np.asarray(work.latencies, dtype=np.float64) / 1e3
    n = len(lat)
    gb = work.bytes / 1e9
    return CellResult(
        engine=engine.name,
        mode=f.mode.value,
        request_bytes=request_bytes,
        queue_depth=queue_depth,
        seconds=elapsed,
        requests=n,
        bytes=work.bytes,
        bytes_per_sec=work.bytes / elapsed if elapsed > 0 else 0.0,
        iops=n / elapsed if elapsed > 0 else 0.0,
        lat_p50_us=float(np.percentile(lat, 50)) if n else float("nan"),
        lat_p99_us=float(np.percentile(lat, 99)) if n else float("nan"),
        lat_mean_us=float(lat.mean()) if n else float("nan"),
        cpu_seconds=cpu,
        cpu_sec_per_gb=cpu / gb if gb > 0 else float("nan"),
        cache_pages_before=before.nr_cache if before else None,
        cache_pages_after=after.nr_cache if after else None,
        evicted_pages=(after.nr_evicted - before.nr_evicted) if before and after else None,
        recently_evicted_pages=after.nr_recently_evicted if after else None,
        exhausted=work.exhausted,
    )
