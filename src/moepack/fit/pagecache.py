"""Stock llama.cpp's expert reads, replayed through a model of Linux's page cache.

Stock llama.cpp reads experts by page faults on its ``mmap`` of the file. What a token reads
is decided by the kernel's page cache, and one LRU of whole read-around windows gets it wrong
both ways (measured on a 2.6 GB 24 x 64 top-8 model, 1 thread: at 1.5 GB of cache it
predicted 294 faults per token against 78 measured; at 0.95 GB it was right only because
everything streams). Three behaviours of the kernel (``mm/vmscan.c``, ``mm/filemap.c``,
``mm/workingset.c``, classic two-list LRU) decide it, and this replay has all three:

- **two lists**: a faulted or read-ahead page starts on the inactive list; reclaim takes the
  inactive list's tail, and a mapped page survives it only if its page tables show an access
  (once: back to the inactive head with a reference mark; twice: onto the active list).
  Read-around pages nobody touches are the first to go, so the experts a token uses are
  protected from the bytes read around them. The active list is trimmed (deactivated) when
  the inactive list is less than ``active / sqrt(10 x GB)``.
- **refault activation**: a page evicted and read again within the active list's size (its
  refault distance) goes straight onto the active list.
- **read-around**: a fault on a missing page reads the window centred on it (only the pages
  not already cached) and marks the page three quarters in; touching a marked page reads the
  next window ahead, asynchronously, without a fault.

The replay runs at a granularity of ``unit`` bytes (128 KiB or more, so a real-sized model
replays in seconds) over the trace's decode tokens, played twice: the first pass warms the
cache, the second is counted. It counts the faults per token; the estimate prices each
with the fault the storage profile measured on this device at the model's slice size.
Checked against measured stock runs in ``benchmarks/bench_fit.py``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

MIN_UNIT = 128 << 10
UNITS_PER_TOKEN = 8192  # the unit grows with the model so a token is at most ~this many

TokenRanges = Sequence[tuple[int, int]]  # (first, last) unit of each slice, in access order


@dataclass(frozen=True)
class Replay:
    """What the counted pass of a replay saw, per token."""

    faults: float  # major faults (sync read-arounds)
    read_units: float  # units read, sync and async


def replay_unit(active_bytes: int, window: int) -> int:
    """The replay's granularity: at least 128 KiB, at most an eighth of a window, and big
    enough that a token touches about ``UNITS_PER_TOKEN`` units."""
    unit = max(MIN_UNIT, active_bytes // UNITS_PER_TOKEN)
    unit = min(unit, max(MIN_UNIT, window // 8))
    return (unit + 4095) // 4096 * 4096


def _inactive_ratio(cache_bytes: int) -> int:
    gb = cache_bytes >> 30
    return math.isqrt(10 * gb) if gb else 1


def replay(
    tokens: Sequence[TokenRanges],
    cache_bytes: int,
    window: int,
    unit: int,
    limits: dict[int, tuple[int, int]],
    counted_from: int,
    *,
    shard_stride: int,
) -> Replay:
    """Replay ``tokens`` (unit ranges) through a page cache of ``cache_bytes`` with fault
    read-around windows of ``window`` bytes; count from token ``counted_from``.
    ``limits`` maps a shard to its units' [first, end) so windows stay inside its file."""
    capacity = max(1, cache_bytes // unit)
    w = max(1, window // unit)
    ratio = _inactive_ratio(cache_bytes)
    # unit -> [young, referenced, readahead mark]; dict order: tail (oldest) first
    inactive: OrderedDict[int, list[bool]] = OrderedDict()
    active: OrderedDict[int, list[bool]] = OrderedDict()
    evicted: dict[int, int] = {}
    age = 0  # evictions and activations: the kernel's nonresident age
    reads = 0

    def state(u: int) -> list[bool] | None:
        s = inactive.get(u)
        return s if s is not None else active.get(u)

    def read(at: int, first: int, end: int) -> None:
        """Read the missing units of [first, end), kept inside the file unit ``at`` is in."""
        nonlocal reads
        lo, hi = limits[at // shard_stride]
        for u in range(max(first, lo), min(end, hi)):
            if u in inactive or u in active:
                continue
            reads += 1
            gone = evicted.pop(u, None)
            if gone is not None and age - gone <= len(active):
                active[u] = [False, False, False]
            else:
                inactive[u] = [False, False, False]

    def reclaim() -> None:
        nonlocal age
        while len(inactive) + len(active) > capacity:
            while active and len(inactive) * ratio < len(active):
                u, s = active.popitem(last=False)
                s[0] = s[1] = False
                inactive[u] = s
            if not inactive:
                u, _ = active.popitem(last=False)
                evicted[u] = age
                age += 1
                continue
            u, s = inactive.popitem(last=False)
            if s[0]:
                s[0] = False
                if s[1]:
                    active[u] = s
                    age += 1
                else:
                    s[1] = True
                    inactive[u] = s
            else:
                evicted[u] = age
                age += 1

    faults_counted = reads_counted = 0
    for index, ranges in enumerate(tokens):
        r0 = reads
        faults = 0
        for first, last in ranges:
            for u in range(first, last + 1):
                s = state(u)
                if s is not None:
                    s[0] = True
                    if u in active:
                        active.move_to_end(u)
                    if s[2]:
                        s[2] = False
                        n = u + 1
                        while n < u + w and state(n) is not None:
                            n += 1
                        read(u, n, n + w)
                        mark = state(n)
                        if mark is not None:
                            mark[2] = True
                        reclaim()
                    continue
                faults += 1
                start = u - w // 2
                read(u, start, start + w)
                mark = state(start + (3 * w) // 4)
                if mark is not None:
                    mark[2] = True
                here = state(u)
                if here is not None:
                    here[0] = True
                reclaim()
        if index >= counted_from:
            faults_counted += faults
            reads_counted += reads - r0
    n = max(1, len(tokens) - counted_from)
    return Replay(faults_counted / n, reads_counted / n)
