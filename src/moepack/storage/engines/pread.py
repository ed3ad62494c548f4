"""``pread``: one ``os.preadv`` at a time — the queue-depth-1 baseline every ratio refers to."""

from __future__ import annotations

from time import perf_counter_ns

from ..buffers import BufferPool
from ..engine import ReadEngine, Workload, read_full
from ..modes import OpenFile

ORDER = 10  # listing order among engines (moepack.registry)


class PreadEngine(ReadEngine):
    name = "pread"
    summary = "os.preadv, one request at a time (queue depth 1)"
    max_depth = 1

    def run(self, f: OpenFile, work: Workload, queue_depth: int) -> None:
        pool = BufferPool(1, work.max_length, f.mem_align)
        try:
            view = pool.views[0]
            while (req := work.next()) is not None:
                token, offset, length = req
                t0 = perf_counter_ns()
                n = read_full(f, view, offset, length)
                work.complete(token, view, n, perf_counter_ns() - t0)
        finally:
            pool.close()


PLUGIN = PreadEngine()
