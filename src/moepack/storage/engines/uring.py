"""``uring`` and ``uring-batch``: io_uring reads through the ctypes ring.

Two ways to keep a queue full, so they can be compared on the user's device:
- ``uring`` (sliding window): every completion is refilled at once, the queue never drains;
- ``uring-batch`` (batch-and-drain): submit ``queue_depth`` reads, wait for all of them, repeat;
  the slowest read of each batch stalls the others.
"""

from __future__ import annotations

from time import perf_counter_ns

from ..buffers import BufferPool
from ..engine import ReadEngine, Workload, register
from ..modes import OpenFile
from ..uring.ring import Ring, ring_unavailable_reason

_unavailable: list[str | None] = []


def _reason() -> str | None:
    if not _unavailable:
        _unavailable.append(ring_unavailable_reason())
    return _unavailable[0]


def _run(f: OpenFile, work: Workload, queue_depth: int, sliding: bool) -> None:
    pool = BufferPool(queue_depth, work.max_length, f.mem_align)
    ring = Ring(queue_depth)
    views = pool.views
    addrs = pool.addresses
    fd, rw_flags, size = f.fd, f.rw_flags, f.size
    # per slot: token, offset, length, bytes so far, start time
    state: list[list[int]] = [[0, 0, 0, 0, 0] for _ in range(queue_depth)]
    free = list(range(queue_depth - 1, -1, -1))
    inflight = 0
    failure: OSError | None = None

    def issue(slot: int) -> bool:
        req = work.next()
        if req is None:
            return False
        token, offset, length = req
        st = state[slot]
        st[0], st[1], st[2], st[3], st[4] = token, offset, length, 0, perf_counter_ns()
        ring.prep_read(fd, addrs[slot], length, offset, rw_flags, slot)
        return True

    try:
        while True:
            while free and failure is None and issue(free[-1]):
                free.pop()
                inflight += 1
            if not inflight:
                break
            wait = 1 if sliding else inflight
            ring.submit_and_wait(wait)
            done = 0
            while done < wait:
                for slot, res in ring.reap():
                    st = state[slot]
                    if res < 0:
                        failure = failure or OSError(-res, f"read at offset {st[1]} failed")
                        inflight -= 1
                        done += 1
                        free.append(slot)
                        continue
                    st[3] += res
                    got = st[3]
                    if res > 0 and got < st[2] and st[1] + got < size:
                        ring.prep_read(  # continue a short read where it stopped
                            fd, addrs[slot] + got, st[2] - got, st[1] + got, rw_flags, slot
                        )
                        continue
                    work.complete(st[0], views[slot], got, perf_counter_ns() - st[4])
                    inflight -= 1
                    done += 1
                    if sliding and failure is None and issue(slot):
                        inflight += 1
                    else:
                        free.append(slot)
                if done < wait:
                    ring.submit_and_wait(1)
        if failure is not None:
            raise failure
    finally:
        _drain(ring, inflight)
        ring.close()
        pool.close()


def _drain(ring: Ring, inflight: int) -> None:
    """Wait out reads still in flight (after an error or Ctrl-C) before freeing buffers."""
    while inflight > 0:
        try:
            ring.submit_and_wait(1)
            inflight -= len(ring.reap())
        except KeyboardInterrupt:
            continue


@register
class UringSlidingEngine(ReadEngine):
    name = "uring"
    summary = "io_uring, sliding window (refill each completion at once)"

    def unavailable_reason(self) -> str | None:
        return _reason()

    def run(self, f: OpenFile, work: Workload, queue_depth: int) -> None:
        _run(f, work, queue_depth, sliding=True)


@register
class UringBatchEngine(ReadEngine):
    name = "uring-batch"
    summary = "io_uring, batch-and-drain (submit a batch, wait for all of it)"

    def unavailable_reason(self) -> str | None:
        return _reason()

    def run(self, f: OpenFile, work: Workload, queue_depth: int) -> None:
        _run(f, work, queue_depth, sliding=False)
