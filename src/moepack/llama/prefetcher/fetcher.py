"""A thread that has the kernel read file ranges into the page cache while llama.cpp computes.

``POSIX_FADV_WILLNEED`` allocates the pages, locks them and submits their reads, then
returns; a page fault on a locked page waits for that read in the kernel instead of issuing
its own, so llama.cpp's matmul can start on a layer's first expert while the last one is
still arriving, and nothing is read twice. Submitting is not free: it allocates pages and, on
a device with a short queue (128 tags on a virtio disk here), blocks until there is room, for
about the time the transfer takes. So it runs on this thread, not on the thread that computes,
in the order the work is given:

- **demand** first: the experts a layer's router chose, in the order its matmuls read them;
- **speculation** after, and only while no demand waits: experts a predictor expects at a
  later layer. Speculation for a layer whose real choice has arrived is dropped unsent.

The kernel caps one WILLNEED at the larger of the device's read-ahead window and its largest
request (``read_ahead_kb``, ``max_sectors_kb``), silently: ranges are cut to that size. Each
piece is looked up first (``cachestat``): a fully cached piece is not asked for, and the bytes
that were missing are counted, so a run can say how many bytes it wanted read and compare
them with what the device delivered.

The thread is C (``native``, built once per process by ``cbuild``): a Python thread would
take the GIL between its system calls, and the eval callback, which runs Python on the
thread that computes, would wait for it (measured: the lookahead's router product took
0.27 ms inside the callback against 25 µs alone). Without a C compiler the same loop runs
as a Python thread (``PyFetcher``). Pieces are rows of int64 ``(shard, expert, offset,
length)``, in the order they are to be read.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter_ns

import numpy as np

from ...storage.device import describe_device
from ...storage.linux import PAGE_SIZE, cachestat
from .native import CFetcher, FetchStats, native_library

FALLBACK_WINDOW = 128 << 10
"""The WILLNEED size when the device's limits cannot be read (small pieces always work)."""


def willneed_window(path: Path) -> int:
    """The most one ``POSIX_FADV_WILLNEED`` reads on the device holding ``path``."""
    try:
        name = describe_device(path).block_device
    except OSError:
        name = None
    if not name:
        return FALLBACK_WINDOW
    queue = Path("/sys/block") / name / "queue"
    best = 0
    for knob in ("read_ahead_kb", "max_sectors_kb"):
        try:
            best = max(best, int((queue / knob).read_text().strip()) << 10)
        except (OSError, ValueError):
            continue
    return max(best, PAGE_SIZE) if best else FALLBACK_WINDOW


@dataclass(frozen=True)
class _Work:
    layer: int
    rows: np.ndarray  # int64 [n, 4]: shard, expert, offset, length
    speculative: bool


class PyFetcher:
    """The read-ahead thread in Python (no C compiler here): the same calls as
    ``CFetcher``."""

    kind = "python"

    def __init__(self, fds: Sequence[int], window: int, cachestat_works: bool = True) -> None:
        self.fds = list(fds)
        self.window = max(PAGE_SIZE, window // PAGE_SIZE * PAGE_SIZE)
        self.cachestat_works = cachestat_works
        self.stats = FetchStats()
        self._spec_read: deque[tuple[int, int, int]] = deque()
        self._demand: deque[_Work] = deque()
        self._spec: deque[_Work] = deque()
        self._last_demand = -1
        self._wake = threading.Condition()
        self._idle = True
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="moepack-fetch", daemon=True)
        self._thread.start()

    def demand(self, layer: int, rows: np.ndarray) -> None:
        """Read ``rows`` (in this order) before anything speculative; drop speculation for
        ``layer`` and earlier layers (all of it at a new pass) that has not been sent."""
        with self._wake:
            self._raise_error()
            new_pass = layer <= self._last_demand
            kept = deque(w for w in self._spec if not new_pass and w.layer > layer)
            self.stats.spec_dropped += sum(len(w.rows) for w in self._spec) - sum(
                len(w.rows) for w in kept
            )
            self._spec = kept
            if layer >= 0:
                self._last_demand = layer
            if len(rows):
                self._demand.append(_Work(layer, np.asarray(rows).reshape(-1, 4), False))
                self._idle = False
                self._wake.notify()

    def speculate(self, layer: int, rows: np.ndarray) -> None:
        """Read ``rows`` when no demand waits (dropped if ``layer``'s demand comes first)."""
        if not len(rows):
            return
        with self._wake:
            self._raise_error()
            self._spec.append(_Work(layer, np.asarray(rows).reshape(-1, 4), True))
            self._idle = False
            self._wake.notify()

    def drain_spec(self) -> list[tuple[int, int, int]]:
        """(layer, expert, bytes read) of the speculative pieces sent since the last call."""
        out = []
        while self._spec_read:
            out.append(self._spec_read.popleft())
        return out

    def _busy(self) -> bool:
        with self._wake:
            return bool(self._demand)

    def wait_idle(self) -> None:
        """Until everything given has been sent."""
        with self._wake:
            while not self._idle and self._error is None:
                self._wake.wait()
            self._raise_error()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._demand.clear()
            self._spec.clear()
            self._wake.notify_all()
        self._thread.join()

    def _raise_error(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def _next(self) -> _Work | None:
        with self._wake:
            while not self._demand and not self._spec:
                self._idle = True
                self._wake.notify_all()
                if self._closed:
                    return None
                self._wake.wait()
            if self._closed:
                return None
            return self._demand.popleft() if self._demand else self._spec.popleft()

    def _loop(self) -> None:
        try:
            while (work := self._next()) is not None:
                if work.speculative:
                    self._speculate(work)
                else:
                    self._demand_work(work)
        except BaseException as e:  # reported to the computing thread at its next call
            with self._wake:
                self._error = e
                self._idle = True
                self._wake.notify_all()

    def _missing(self, shard: int, offset: int, length: int) -> int:
        """Bytes of the range not in the page cache (all of it when cachestat cannot tell)."""
        if not self.cachestat_works:
            return length
        cached = cachestat(self.fds[shard], offset, length).nr_cache
        return min(length, max(0, _pages(offset, length) - cached) * PAGE_SIZE)

    def _demand_work(self, work: _Work) -> None:
        """Look every piece up (an expert is a hit when all its bytes are cached), then ask
        for the missing ones in the given order."""
        st = self.stats
        rows = [tuple(int(v) for v in r) for r in work.rows]
        missing = [self._missing(sh, off, n) for sh, _e, off, n in rows]
        st.demand_pieces += len(rows)
        st.demand_bytes += sum(r[3] for r in rows)
        st.demand_missing += sum(missing)
        resident: dict[int, bool] = {}
        for (_sh, e, _off, _n), gap in zip(rows, missing, strict=True):
            resident[e] = resident.get(e, True) and gap == 0
        st.demand_experts += len(resident)
        st.demand_hits += sum(resident.values())
        for (sh, _e, off, n), gap in zip(rows, missing, strict=True):
            if gap:
                self._submit(sh, off, n)

    def _speculate(self, work: _Work) -> None:
        """Ask for the pieces one by one, stopping as soon as demand waits: the rest goes
        back to the head of the speculation queue (unless that demand made it stale)."""
        st = self.stats
        for i, row in enumerate(work.rows):
            if self._busy():
                with self._wake:
                    if work.layer > self._last_demand:
                        self._spec.appendleft(_Work(work.layer, work.rows[i:], True))
                    else:
                        st.spec_dropped += len(work.rows) - i
                return
            sh, e, off, n = (int(v) for v in row)
            gap = self._missing(sh, off, n)
            st.spec_pieces += 1
            st.spec_bytes += n
            st.spec_missing += gap
            self._spec_read.append((work.layer, e, gap))
            if gap:
                self._submit(sh, off, n)

    def _submit(self, shard: int, offset: int, length: int) -> None:
        st = self.stats
        fd = self.fds[shard]
        t0 = perf_counter_ns()
        for off in range(offset, offset + length, self.window):
            n = min(self.window, offset + length - off)
            try:
                os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
            except OSError:
                st.errors += 1
            st.willneed_calls += 1
        st.ns_submitting += perf_counter_ns() - t0


def _pages(offset: int, length: int) -> int:
    first = offset // PAGE_SIZE
    last = (offset + length - 1) // PAGE_SIZE
    return last - first + 1


def make_fetcher(fds: Sequence[int], window: int, cachestat_works: bool) -> CFetcher | PyFetcher:
    """The C thread where a compiler is at hand, else the Python one."""
    lib = native_library()
    if lib is not None:
        return CFetcher(lib, fds, window, cachestat_works)
    return PyFetcher(fds, window, cachestat_works)
