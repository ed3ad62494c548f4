"""``mmap``: copy out of a read-only memory map; each cold page is a synchronous page fault.

What ``llama.cpp --mmap`` does for weights; queue depth 1 and buffered only (a mapping always
goes through the page cache). The mapping is MADV_RANDOM (no read-around past the request) and
each request is announced with MADV_WILLNEED first, so its pages come in as one read instead
of one fault per page: the best a plain mmap reader can do.
"""

from __future__ import annotations

import mmap as _mmap
from time import perf_counter_ns

from ..buffers import BufferPool
from ..engine import ReadEngine, Workload
from ..linux import PAGE_SIZE
from ..modes import Mode, OpenFile

ORDER = 40  # listing order among engines (moepack.registry)


class MmapEngine(ReadEngine):
    name = "mmap"
    summary = "memory-mapped reads (page faults), queue depth 1"
    modes = frozenset({Mode.BUFFERED})
    max_depth = 1

    def run(self, f: OpenFile, work: Workload, queue_depth: int) -> None:
        pool = BufferPool(1, work.max_length, 1)
        mm = _mmap.mmap(f.fd, f.size, access=_mmap.ACCESS_READ) if f.size else None
        whole = memoryview(mm) if mm is not None else memoryview(b"")
        try:
            if mm is not None and hasattr(_mmap, "MADV_RANDOM"):
                mm.madvise(_mmap.MADV_RANDOM)
            view = pool.views[0]
            while (req := work.next()) is not None:
                token, offset, length = req
                t0 = perf_counter_ns()
                n = max(0, min(length, f.size - offset))
                if n and mm is not None:
                    start = offset - offset % PAGE_SIZE
                    mm.madvise(_mmap.MADV_WILLNEED, start, offset + n - start)
                    view[:n] = whole[offset : offset + n]
                work.complete(token, view, n, perf_counter_ns() - t0)
        finally:
            whole.release()
            if mm is not None:
                mm.close()
            pool.close()


PLUGIN = MmapEngine()
