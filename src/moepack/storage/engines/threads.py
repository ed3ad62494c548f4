"""``threads``: a pool of threads each looping over ``os.preadv``.

``preadv`` releases the GIL while the kernel reads, so N threads keep N reads in flight:
real queue depth from plain Python, in every mode (buffered, O_DIRECT, DONTCACHE).
"""

from __future__ import annotations

import threading
from time import perf_counter_ns

from ..buffers import BufferPool
from ..engine import ReadEngine, Workload, read_full
from ..modes import OpenFile

ORDER = 20  # listing order among engines (moepack.registry)


class ThreadsEngine(ReadEngine):
    name = "threads"
    summary = "thread pool over os.preadv (one thread per unit of queue depth)"

    def run(self, f: OpenFile, work: Workload, queue_depth: int) -> None:
        pool = BufferPool(queue_depth, work.max_length, f.mem_align)
        lock = threading.Lock()
        stop = threading.Event()
        errors: list[BaseException] = []

        def worker(view: memoryview) -> None:
            try:
                while not stop.is_set():
                    with lock:
                        req = work.next()
                    if req is None:
                        return
                    token, offset, length = req
                    t0 = perf_counter_ns()
                    n = read_full(f, view, offset, length)
                    lat = perf_counter_ns() - t0
                    with lock:
                        work.complete(token, view, n, lat)
            except BaseException as e:  # surfaced in the calling thread below
                errors.append(e)
                stop.set()

        workers = [
            threading.Thread(target=worker, args=(v,), name=f"moepack-read-{i}", daemon=True)
            for i, v in enumerate(pool.views)
        ]
        try:
            for t in workers:
                t.start()
            for t in workers:
                while t.is_alive():  # a timed join lets Ctrl-C reach this thread
                    t.join(0.05)
        finally:
            stop.set()
            for t in workers:
                while t.is_alive():
                    try:
                        t.join()
                    except KeyboardInterrupt:  # keep waiting: buffers are still in use
                        continue
            pool.close()
        if errors:
            raise errors[0]


PLUGIN = ThreadsEngine()
