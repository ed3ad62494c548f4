"""``uring`` and ``uring-batch``: io_uring reads through the ctypes ring.

Two ways to keep a queue full, so they can be compared on the user's device:
- ``uring`` (sliding window): every completion is refilled at once, the queue never drains;
- ``uring-batch`` (batch-and-drain): submit ``queue_depth`` reads, wait for all of them, repeat;
  the slowest read of each batch stalls the others.

However the run ends (done, a failed read, Ctrl-C at any bytecode), the ring's own count of
reads not yet reaped decides what is still in flight; ``_finish`` waits for those (bounded,
holding further Ctrl-C) before the buffers are unmapped, and keeps the buffers mapped when a
read could not be reaped or cancelled in time, so the kernel never writes into freed memory.
"""

from __future__ import annotations

from time import perf_counter_ns

from ...interrupts import check, deferred, raised
from ..buffers import BufferPool
from ..engine import ReadEngine, Workload
from ..interrupts import deliver, hold_sigint
from ..modes import OpenFile
from ..uring.ring import Ring, ring_unavailable_reason

ORDER = 30  # listing order among engines (moepack.registry)

_unavailable: list[str | None] = []

DRAIN_SECONDS = 10.0  # waiting for reads in flight after an error or Ctrl-C, before cancelling
CANCEL_GRACE_SECONDS = 2.0  # waiting for the cancelled ones


def _reason() -> str | None:
    if not _unavailable:
        _unavailable.append(ring_unavailable_reason())
    return _unavailable[0]


def _loop(
    ring: Ring, pool: BufferPool, f: OpenFile, work: Workload, queue_depth: int, sliding: bool
) -> None:
    # The hot path of every uring measurement: locals only, one clock read per completion
    # batch (completion time of what it reaps, start time of what it refills), no helper
    # calls but the workload's and the ring's, and one truth test per batch for a Ctrl-C
    # that code catching every exception took away (``moepack.interrupts``): the wait below
    # ends with every batch, so that is where a lost interrupt is raised again.
    views = pool.views
    addrs = pool.addresses
    fd, rw_flags, size = f.fd, f.rw_flags, f.size
    next_request, complete = work.next, work.complete
    prep, submit_and_wait, reap = ring.prep_read, ring.submit_and_wait, ring.reap
    clock = perf_counter_ns
    tokens = [0] * queue_depth
    offsets = [0] * queue_depth
    lengths = [0] * queue_depth
    done_bytes = [0] * queue_depth
    started = [0] * queue_depth
    free = list(range(queue_depth - 1, -1, -1))
    inflight = 0  # this loop's view; the ring's ``outstanding`` is the one cleanup trusts
    failure: OSError | None = None
    stopping = raised()

    now = clock()
    while True:
        if stopping:
            check()
        while free and failure is None:
            req = next_request()
            if req is None:
                break
            slot = free.pop()
            tokens[slot], offsets[slot], lengths[slot] = req
            done_bytes[slot] = 0
            started[slot] = now
            prep(fd, addrs[slot], req[2], req[1], rw_flags, slot)
            inflight += 1
        if not inflight:
            break
        wait = 1 if sliding else inflight
        submit_and_wait(wait)
        done = 0
        while done < wait:
            now = clock()
            for slot, res in reap():
                if res < 0:
                    failure = failure or OSError(-res, f"read at offset {offsets[slot]} failed")
                    inflight -= 1
                    done += 1
                    free.append(slot)
                    continue
                got = done_bytes[slot] + res
                done_bytes[slot] = got
                if res > 0 and got < lengths[slot] and offsets[slot] + got < size:
                    prep(  # continue a short read where it stopped
                        fd,
                        addrs[slot] + got,
                        lengths[slot] - got,
                        offsets[slot] + got,
                        rw_flags,
                        slot,
                    )
                    continue
                complete(tokens[slot], views[slot], got, now - started[slot])
                inflight -= 1
                done += 1
                if sliding and failure is None and (req := next_request()) is not None:
                    tokens[slot], offsets[slot], lengths[slot] = req
                    done_bytes[slot] = 0
                    started[slot] = now
                    prep(fd, addrs[slot], req[2], req[1], rw_flags, slot)
                    inflight += 1
                else:
                    free.append(slot)
            if done < wait:
                submit_and_wait(1)
        now = clock()
    if failure is not None:
        raise failure
    ring.check_counters()


def _finish(ring: Ring, pool: BufferPool | None) -> None:
    """Reap what is in flight, close the ring, free the buffers — or keep them mapped when a
    read is still running. Ctrl-C meanwhile is held (a second one stops the waiting early)
    and raised once everything is released."""
    pressed = False
    previous: object = None
    for _ in range(3):  # again only if Ctrl-C came before the handler that holds it was set
        try:
            with hold_sigint() as held:
                previous = held.previous
                if not ring.closed:
                    drained = ring.drain(DRAIN_SECONDS, CANCEL_GRACE_SECONDS, held.pressed)
                    ring.close()
                    if pool is not None:
                        if drained:
                            pool.close()
                        else:
                            pool.abandon()
            pressed = pressed or held.pressed()
            break
        except KeyboardInterrupt:
            pressed = True
    if pressed:
        deliver(previous)


def _run(f: OpenFile, work: Workload, queue_depth: int, sliding: bool) -> None:
    ring: Ring | None = None
    pool: BufferPool | None = None
    try:
        # made whole before an interrupt is raised: one that came the instant the ring
        # existed, before it was ``ring`` here, left its descriptor and mappings open
        with deferred():
            ring = Ring(queue_depth)
            pool = BufferPool(queue_depth, work.max_length, f.mem_align)
        _loop(ring, pool, f, work, queue_depth, sliding)
    finally:
        if ring is not None:
            _finish(ring, pool)
        elif pool is not None:  # pragma: no cover - the pool is made after the ring
            pool.close()


class UringSlidingEngine(ReadEngine):
    name = "uring"
    summary = "io_uring, sliding window (refill each completion at once)"

    def unavailable_reason(self) -> str | None:
        return _reason()

    def run(self, f: OpenFile, work: Workload, queue_depth: int) -> None:
        _run(f, work, queue_depth, sliding=True)


class UringBatchEngine(ReadEngine):
    name = "uring-batch"
    summary = "io_uring, batch-and-drain (submit a batch, wait for all of it)"

    def unavailable_reason(self) -> str | None:
        return _reason()

    def run(self, f: OpenFile, work: Workload, queue_depth: int) -> None:
        _run(f, work, queue_depth, sliding=False)


PLUGINS = (UringSlidingEngine(), UringBatchEngine())
