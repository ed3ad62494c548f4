"""One measurement cell: an engine, a mode, a request size and a queue depth, time-bounded.

Each cell starts cold: the file's pages are dropped (POSIX_FADV_DONTNEED) and the residency
is checked with cachestat before and after. Offsets are aligned to the request size and
come in a random order of the file's slots (``SlotPermutation``: a keyed bijection, O(1)
memory, made before the clock starts), so within a cell no block is read twice and a
buffered read can never be served by a page an earlier read of the same cell brought in. In
O_DIRECT mode (no cache) a new order starts when the file is used up; in the cached modes
the cell ends there instead, and says so.
"""

from __future__ import annotations

import math
import os
import resource
import statistics
from array import array
from dataclasses import dataclass, field
from time import perf_counter_ns

import numpy as np

from ..errors import BadInput
from ..interrupts import check
from ..pages import drop_cached
from ..progress import NULL_PROGRESS, ProgressSink
from .buffers import release_idle
from .engine import ReadEngine
from .linux import PAGE_SIZE, CacheStat, cachestat
from .modes import Mode, OpenFile


@dataclass
class CellResult:
    """What one cell measured: one run, or (``repeats`` > 1) the combination of several.

    A combined cell reports medians over its runs (GB/s, IOPS, latency percentiles, CPU per
    GB, residency), sums of what was read, and the spread of its GB/s (lowest, highest run).
    """

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
    cache_pages_before: int | None  # file pages in the page cache after the drop (max of runs)
    cache_pages_after: int | None  # ... and when the cell ended
    evicted_pages: int | None  # file pages the kernel evicted under pressure during the cell
    recently_evicted_pages: int | None
    exhausted: bool  # the cell read the whole file before its time was up
    residency: float | None = None  # share of the bytes read still cached afterwards
    repeats: int = 1
    bytes_per_sec_low: float | None = None  # the slowest run's GB/s (spread)
    bytes_per_sec_high: float | None = None  # the fastest run's
    runs_bytes_per_sec: list[float] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.bytes_per_sec / 1e9

    @property
    def low(self) -> float:
        """Lowest bytes/s of the runs (the cell's own when measured once)."""
        return self.bytes_per_sec if self.bytes_per_sec_low is None else self.bytes_per_sec_low

    @property
    def high(self) -> float:
        return self.bytes_per_sec if self.bytes_per_sec_high is None else self.bytes_per_sec_high


def _median(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else float("nan")


def _opt(values: list[int | None], fn):  # type: ignore[no-untyped-def]
    got = [v for v in values if v is not None]
    return fn(got) if got else None


def combine(runs: list[CellResult]) -> CellResult:
    """One cell from several runs of it: medians, sums, and the spread of GB/s."""
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    bps = [r.bytes_per_sec for r in runs]
    res = [r.residency for r in runs if r.residency is not None]
    return CellResult(
        engine=first.engine,
        mode=first.mode,
        request_bytes=first.request_bytes,
        queue_depth=first.queue_depth,
        seconds=sum(r.seconds for r in runs),
        requests=sum(r.requests for r in runs),
        bytes=sum(r.bytes for r in runs),
        bytes_per_sec=statistics.median(bps),
        iops=statistics.median(r.iops for r in runs),
        lat_p50_us=_median([r.lat_p50_us for r in runs]),
        lat_p99_us=_median([r.lat_p99_us for r in runs]),
        lat_mean_us=_median([r.lat_mean_us for r in runs]),
        cpu_seconds=sum(r.cpu_seconds for r in runs),
        cpu_sec_per_gb=_median([r.cpu_sec_per_gb for r in runs]),
        cache_pages_before=_opt([r.cache_pages_before for r in runs], max),
        cache_pages_after=_opt([r.cache_pages_after for r in runs], max),
        evicted_pages=_opt([r.evicted_pages for r in runs], sum),
        recently_evicted_pages=_opt([r.recently_evicted_pages for r in runs], max),
        exhausted=any(r.exhausted for r in runs),
        residency=statistics.median(res) if res else None,
        repeats=len(runs),
        bytes_per_sec_low=min(bps),
        bytes_per_sec_high=max(bps),
        runs_bytes_per_sec=bps,
    )


def spreads_overlap(a: CellResult, b: CellResult) -> bool:
    """Whether two cells' ranges of GB/s over their runs overlap: no clear winner."""
    return a.low <= b.high and b.low <= a.high


class SlotPermutation:
    """A pseudo-random order of the slots ``0 .. n-1``, each exactly once, in O(1) memory.

    A keyed bijection ``pi`` of ``[0, 2**k)`` (``2**k`` the next power of two >= n), built from
    steps that are each invertible mod ``2**k`` (add a key, xor-shift right, multiply by an odd
    key), is applied to a counter ``0, 1, 2, ...``; values >= n are skipped (fewer than half).
    So no slot repeats until every slot has come once, nothing proportional to ``n`` is ever
    held, and numbers are made in batches with numpy (tens of ns each).
    """

    ROUNDS = 3

    def __init__(self, n: int, seed: int, batch: int = 4096) -> None:
        if n < 1:
            raise ValueError("a permutation needs at least one slot")
        self.n = n
        self.bits = max(1, (n - 1).bit_length())
        self._mask = np.uint64((1 << self.bits) - 1)
        self._shift = np.uint64(self.bits // 2 + 1)
        rng = np.random.default_rng(seed)
        words = rng.integers(0, 1 << 63, size=(self.ROUNDS, 2), dtype=np.uint64)
        self._keys = [(np.uint64(a) & self._mask, np.uint64(m) | np.uint64(1)) for a, m in words]
        self._counter = 0
        self._batch = batch

    def _mix(self, x: np.ndarray) -> np.ndarray:
        mask, shift = self._mask, self._shift
        with np.errstate(over="ignore"):
            for add, mul in self._keys:
                x = (x + add) & mask
                x ^= x >> shift
                x = (x * mul) & mask
            x ^= x >> shift
        return x

    def take(self) -> list[int]:
        """The next slots in order ([] once every slot has been given)."""
        domain = 1 << self.bits
        while self._counter < domain:
            hi = min(domain, self._counter + self._batch)
            x = self._mix(np.arange(self._counter, hi, dtype=np.uint64))
            self._counter = hi
            x = x[x < np.uint64(self.n)]
            if x.size:
                return x.tolist()
        return []


class RandomWork:
    """Random request-aligned offsets until the deadline (or one pass, in cached modes).

    Made before the clock starts; offsets come from a ``SlotPermutation``, so neither time
    nor memory grows with the file's size. ``start(seconds)`` sets the time budget; the clock
    (``t0_ns``, and ``cpu0`` for CPU time) starts at the first request, i.e. once the engine
    has its buffers and queues ready — as fio times a job after allocating its buffers.
    """

    def __init__(
        self,
        file_size: int,
        request_bytes: int,
        wrap: bool,
        seed: int,
        min_requests: int = 0,
    ) -> None:
        self.max_length = request_bytes
        self._slots = file_size // request_bytes
        if self._slots < 1:
            raise ValueError("the file holds no whole request")
        self._seed = seed
        self._passes = 0
        self._perm = SlotPermutation(self._slots, seed)
        self._offsets = self._perm.take()
        self._i = 0
        self._deadline = 1 << 62
        self._budget_ns: int | None = None
        self.t0_ns: int | None = None  # when the first request was handed out
        self.cpu0 = 0.0
        self._wrap = wrap
        self._min = min_requests
        self.issued = 0
        self.exhausted = False
        self.latencies = array("q")  # ns per request: 8 bytes each, nothing else per request
        self.bytes = 0

    def start(self, seconds: float) -> None:
        """No request is handed out ``seconds`` after the first one (see ``min_requests``)."""
        self._budget_ns = round(seconds * 1e9)

    def _begin(self) -> None:
        self.cpu0 = _cpu()
        self.t0_ns = perf_counter_ns()
        if self._budget_ns is not None:
            self._deadline = self.t0_ns + self._budget_ns

    def _refill(self) -> bool:
        self._offsets = self._perm.take()
        if not self._offsets:
            self.exhausted = True
            if not self._wrap:
                return False
            self._passes += 1
            self._perm = SlotPermutation(self._slots, self._seed * 1_000_003 + self._passes)
            self._offsets = self._perm.take()
        self._i = 0
        return True

    def next(self) -> tuple[int, int, int] | None:
        if self.t0_ns is None:
            self._begin()
        if self.issued >= self._min and perf_counter_ns() >= self._deadline:
            return None
        if self._i >= len(self._offsets) and not self._refill():
            return None
        off = self._offsets[self._i] * self.max_length
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
    drop_cached(f.fd)
    cs = _cachestat(f.fd)
    if cs is not None and (cs.nr_dirty or cs.nr_writeback):
        os.fdatasync(f.fd)
        drop_cached(f.fd)
        cs = _cachestat(f.fd)
    return cs


def _residency(before: CacheStat | None, after: CacheStat | None, nbytes: int) -> float | None:
    """Share of the bytes a cell read that the page cache holds afterwards."""
    if before is None or after is None or not nbytes:
        return None
    gained = max(0, after.nr_cache - before.nr_cache) * PAGE_SIZE
    return min(1.0, gained / nbytes)


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


MIN_REQUEST_BYTES = 512
"""Smaller requests measure Python's per-call cost, not the device (and O_DIRECT needs 512)."""
MAX_CELL_SECONDS = 3600.0


def check_cell_seconds(seconds: float) -> None:
    """``BadInput`` unless ``seconds`` is a finite time of at most an hour."""
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds)):
        raise BadInput(f"cell time must be a finite number of seconds, got {seconds}")
    if not 0 < seconds <= MAX_CELL_SECONDS:
        raise BadInput(
            f"cell time must be above 0 and at most {MAX_CELL_SECONDS:g} s, got {seconds:g}"
        )


def check_request_sizes(sizes: list[int], f: OpenFile | None = None) -> None:
    """``BadInput`` for request sizes below 512 B, or (``f`` open for O_DIRECT) not a multiple
    of its alignment — the message says which sizes and why."""
    small = [s for s in sizes if s < MIN_REQUEST_BYTES]
    if small:
        raise BadInput(
            f"request size{'s' if len(small) > 1 else ''} {', '.join(map(str, small))} "
            f"{'are' if len(small) > 1 else 'is'} below {MIN_REQUEST_BYTES} B: O_DIRECT cannot read less than a sector, and "
            "smaller buffered reads measure per-call overhead, not the device"
        )
    if f is not None:
        bad = [s for s in sizes if s % f.offset_align]
        if bad:
            raise BadInput(alignment_problem(bad, f.offset_align), f.path)


def alignment_problem(sizes: list[int], align: int) -> str:
    return (
        f"request size{'s' if len(sizes) > 1 else ''} {', '.join(f'{s:,}' for s in sizes)} "
        f"{'are' if len(sizes) > 1 else 'is'} not a multiple of the O_DIRECT alignment "
        f"({align} bytes) of this file"
    )


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
    check_cell_seconds(seconds)
    check_request_sizes([request_bytes], f)
    if f.size < request_bytes:
        raise BadInput(
            f"file holds {f.size:,} bytes, less than one request of {request_bytes:,}", f.path
        )
    before = _make_cold(f)
    work = RandomWork(
        f.size,
        request_bytes,
        wrap=f.mode is Mode.DIRECT,
        seed=seed,
        min_requests=2 * queue_depth,  # at least one refill of the whole queue, however slow
    )
    work.start(seconds)
    check()  # a Ctrl-C swallowed while the cell was made (numpy.random's first import) ends it
    engine.run(f, work, queue_depth)  # the clock runs from its first request (work.t0_ns)
    end = perf_counter_ns()
    cpu = _cpu() - work.cpu0
    elapsed = (end - (work.t0_ns or end)) / 1e9
    after = _cachestat(f.fd)
    lat = np.frombuffer(work.latencies, dtype=np.int64) / 1e3
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
        residency=_residency(before, after, work.bytes),
    )


def measure_interleaved(
    plan: list[tuple[OpenFile, ReadEngine, int, int]],
    seconds: float,
    repeats: int,
    progress: ProgressSink = NULL_PROGRESS,
) -> list[CellResult]:
    """Measure every ``(file, engine, request size, depth)`` of ``plan`` ``repeats`` times,
    round by round (each round in the opposite order of the last), and combine each cell's
    runs: a device whose speed drifts over a minute then spreads the drift over every cell
    instead of handing it to whichever cells ran during a slow spell."""
    check_repeats(repeats)
    runs: list[list[CellResult]] = [[] for _ in plan]
    try:
        for rnd in range(repeats):
            order = range(len(plan)) if rnd % 2 == 0 else range(len(plan) - 1, -1, -1)
            for i in order:
                f, engine, size, qd = plan[i]
                seed = rnd * len(plan) + i
                runs[i].append(measure_cell(f, engine, size, qd, seconds, seed=seed))
                progress.advance(1)
    finally:
        release_idle()  # pools were reused from run to run; give their memory back now
    return [combine(r) for r in runs]


MAX_REPEATS = 100


def check_repeats(repeats: int) -> None:
    if not 1 <= repeats <= MAX_REPEATS:
        raise BadInput(f"repeats must be 1 to {MAX_REPEATS}, got {repeats}")
