"""A minimal io_uring over the raw syscalls, through ctypes.

Why not a binding: on this project's machines PyPI ``liburing`` dies with SIGILL when a ring is
created and ``pyuring`` does not build (see ``bindings.py`` and ``docs/storage.md``). Reads
need very little of io_uring — set up a ring, put READ entries in the submission queue, enter,
reap completions — so this module does exactly that with ``io_uring_setup`` (425) and
``io_uring_enter`` (426) and the SQ/CQ rings mapped with ``mmap``. No C code runs but the
kernel's, so nothing here can die of an instruction this CPU lacks.

Memory ordering. The rings are shared with the kernel, and C code would read the CQ tail with
a load-acquire and store the heads and tails with store-release. Python cannot: a memoryview
access is a plain load or store, and CPython promises no barrier around it. So the ring is
only ever set up with ``IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN`` (Linux 6.1+)
and never with SQPOLL. Then every kernel access to the rings happens inside
``io_uring_enter`` called by this thread: the kernel reads the SQEs and moves the SQ head
while submitting, and posts completions (CQEs and the CQ tail) only while running this
task's deferred work in ``io_uring_enter(GETEVENTS)``; no interrupt handler or io-wq worker
touches the CQ. Every write the kernel makes is therefore ordered before the syscall returns
to the same thread, and every store of ours before the syscall that reads it — program order,
on any architecture. Where a kernel lacks DEFER_TASKRUN the ring refuses to start
(``RingUnsupported``) and the engines fall back to ``threads``, saying why, rather than read
completions that, on a weakly ordered CPU (aarch64), another CPU may still be writing.

Accounting that survives Ctrl-C. Every prepared read produces exactly one completion, so
"reads not yet reaped" is ``SQ tail (ours) - CQ head`` — two counters that each change in a
single store. ``outstanding`` is exact whenever Python raises ``KeyboardInterrupt``, whatever
the caller's own bookkeeping was doing, and ``drain`` waits for it to reach 0 (bounded: after
a timeout it cancels what is left with IORING_OP_ASYNC_CANCEL, and reports when even that
does not finish, so the caller keeps the buffers mapped instead of freeing memory the kernel
may still write).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import struct
from collections.abc import Callable
from time import monotonic

from ...safeio import os_error_text
from ..linux import LIBC, SYS_IO_URING_ENTER, SYS_IO_URING_SETUP, _syscall

IORING_OFF_SQ_RING = 0
IORING_OFF_CQ_RING = 0x8000000
IORING_OFF_SQES = 0x10000000
IORING_FEAT_SINGLE_MMAP = 1 << 0
IORING_FEAT_EXT_ARG = 1 << 8
IORING_SETUP_CQSIZE = 1 << 3
IORING_SETUP_SUBMIT_ALL = 1 << 7
IORING_SETUP_SINGLE_ISSUER = 1 << 12
IORING_SETUP_DEFER_TASKRUN = 1 << 13
IORING_ENTER_GETEVENTS = 1 << 0
IORING_ENTER_EXT_ARG = 1 << 3
IORING_OP_ASYNC_CANCEL = 14
IORING_OP_READ = 22
IORING_ASYNC_CANCEL_ANY = 1 << 2
IORING_MAX_ENTRIES = 32768  # the kernel refuses larger rings (EINVAL)

SETUP_FLAGS = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_SUBMIT_ALL
CANCEL_USER_DATA = (1 << 64) - 1  # the completion of a cancel request, not of a read

_SQE = struct.Struct("<BBHiQQIIQHHiQQ")  # struct io_uring_sqe, 64 bytes
_SQE_HEAD = struct.Struct("<BBHiQQIIQ")  # its first 48 bytes; the rest stays zero for reads
_CQE = struct.Struct("<QiI")  # struct io_uring_cqe, 16 bytes
assert _SQE.size == 64 and _CQE.size == 16

# io_uring_enter through syscall(2) with a fixed prototype: ctypes converts plain ints without
# building argument objects on every call (the hot path of the engines). glibc's syscall() is
# a register shuffle, so a fixed-arity call is the same as the variadic one on Linux ABIs.
_enter = ctypes.CFUNCTYPE(
    ctypes.c_long,
    ctypes.c_long,
    ctypes.c_uint,
    ctypes.c_uint,
    ctypes.c_uint,
    ctypes.c_uint,
    ctypes.c_void_p,
    ctypes.c_size_t,
    use_errno=True,
)(("syscall", LIBC))


class _SqOffsets(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_uint32)
        for n in ("head", "tail", "ring_mask", "ring_entries", "flags", "dropped", "array", "resv1")
    ] + [("user_addr", ctypes.c_uint64)]


class _CqOffsets(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_uint32)
        for n in ("head", "tail", "ring_mask", "ring_entries", "overflow", "cqes", "flags", "resv1")
    ] + [("user_addr", ctypes.c_uint64)]


class _Params(ctypes.Structure):
    _fields_ = [
        ("sq_entries", ctypes.c_uint32),
        ("cq_entries", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("sq_thread_cpu", ctypes.c_uint32),
        ("sq_thread_idle", ctypes.c_uint32),
        ("features", ctypes.c_uint32),
        ("wq_fd", ctypes.c_uint32),
        ("resv", ctypes.c_uint32 * 3),
        ("sq_off", _SqOffsets),
        ("cq_off", _CqOffsets),
    ]


class _Timespec(ctypes.Structure):  # struct __kernel_timespec
    _fields_ = [("tv_sec", ctypes.c_int64), ("tv_nsec", ctypes.c_int64)]


class _GeteventsArg(ctypes.Structure):  # struct io_uring_getevents_arg
    _fields_ = [
        ("sigmask", ctypes.c_uint64),
        ("sigmask_sz", ctypes.c_uint32),
        ("min_wait_usec", ctypes.c_uint32),
        ("ts", ctypes.c_uint64),
    ]


assert ctypes.sizeof(_Params) == 120 and ctypes.sizeof(_GeteventsArg) == 24


class RingUnsupported(OSError):
    """The kernel cannot give this module a ring it can use safely from Python."""


def _setup(entries: int, flags: int) -> tuple[int, _Params]:
    params = _Params()
    params.flags = flags | IORING_SETUP_CQSIZE
    params.cq_entries = entries * 2
    fd = _syscall(ctypes.c_long(SYS_IO_URING_SETUP), ctypes.c_uint(entries), ctypes.byref(params))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd, params


class Ring:
    """One io_uring instance for reads: ``prep_read`` entries, ``submit_and_wait``, ``reap``.

    Use it from the thread that created it (SINGLE_ISSUER). ``outstanding`` counts reads
    prepared and not yet reaped; ``drain`` waits them out before the buffers may be freed.
    """

    def __init__(self, entries: int) -> None:
        if not 1 <= entries <= IORING_MAX_ENTRIES:
            raise ValueError(f"a ring holds 1 to {IORING_MAX_ENTRIES} entries, not {entries}")
        entries = 1 << (entries - 1).bit_length()
        try:
            fd, p = _setup(entries, SETUP_FLAGS)
        except OSError as e:
            if e.errno == errno.EINVAL:
                raise RingUnsupported(
                    errno.EINVAL,
                    "this kernel's io_uring lacks IORING_SETUP_DEFER_TASKRUN (Linux 6.1+), "
                    "which moepack's ring needs to read completions safely from Python",
                ) from None
            raise
        self.fd = fd
        self.flags = p.flags
        self.entries = p.sq_entries
        self._closed = False
        try:
            if not p.features & IORING_FEAT_EXT_ARG:  # pragma: no cover - every 6.1+ kernel
                raise RingUnsupported(errno.EINVAL, "io_uring without IORING_FEAT_EXT_ARG")
            self._map(p)
        except BaseException:
            os.close(fd)
            self._closed = True
            raise
        self._tail = self._sq[self._sq_tail_i]
        self._ts = _Timespec()
        self._arg = _GeteventsArg(0, 0, 0, ctypes.addressof(self._ts))
        self._arg_addr = ctypes.addressof(self._arg)

    def _map(self, p: _Params) -> None:
        sq_size = p.sq_off.array + p.sq_entries * 4
        cq_size = p.cq_off.cqes + p.cq_entries * _CQE.size
        rw = mmap.PROT_READ | mmap.PROT_WRITE
        if p.features & IORING_FEAT_SINGLE_MMAP:
            sq_size = cq_size = max(sq_size, cq_size)
        self._sq_mm = mmap.mmap(self.fd, sq_size, mmap.MAP_SHARED, rw, offset=IORING_OFF_SQ_RING)
        if p.features & IORING_FEAT_SINGLE_MMAP:
            self._cq_mm = self._sq_mm
        else:
            self._cq_mm = mmap.mmap(
                self.fd, cq_size, mmap.MAP_SHARED, rw, offset=IORING_OFF_CQ_RING
            )
        self._sqe_mm = mmap.mmap(
            self.fd, p.sq_entries * _SQE.size, mmap.MAP_SHARED, rw, offset=IORING_OFF_SQES
        )
        self._sq = memoryview(self._sq_mm).cast("I")
        self._cq = memoryview(self._cq_mm).cast("I")
        self._sq_head_i = p.sq_off.head // 4
        self._sq_tail_i = p.sq_off.tail // 4
        self._sq_dropped_i = p.sq_off.dropped // 4
        self._sq_mask = self._sq[p.sq_off.ring_mask // 4]
        self._cq_head_i = p.cq_off.head // 4
        self._cq_tail_i = p.cq_off.tail // 4
        self._cq_overflow_i = p.cq_off.overflow // 4
        self._cq_mask = self._cq[p.cq_off.ring_mask // 4]
        self._cqes = p.cq_off.cqes
        array_i = p.sq_off.array // 4
        for i in range(p.sq_entries):  # SQ index array: slot i holds SQE i, once and for all
            self._sq[array_i + i] = i

    # -- submission ------------------------------------------------------------------------

    def space(self) -> int:
        """Free submission slots."""
        return self.entries - ((self._tail - self._sq[self._sq_head_i]) & 0xFFFFFFFF)

    def prep_read(
        self, fd: int, addr: int, length: int, offset: int, rw_flags: int, user_data: int
    ) -> None:
        """Queue one read of ``length`` bytes at ``offset`` into memory at ``addr``."""
        tail = self._tail
        # opcode, flags, ioprio, fd, off, addr, len, rw_flags, user_data; bytes 48..63 stay
        # zero (the ring is mmap'd zeroed, and prep_cancel_all writes 0 there)
        sqe = (IORING_OP_READ, 0, 0, fd, offset, addr, length, rw_flags, user_data)
        _SQE_HEAD.pack_into(self._sqe_mm, (tail & self._sq_mask) * 64, *sqe)
        self._tail = (tail + 1) & 0xFFFFFFFF  # one store: the entry now counts as outstanding

    def prep_cancel_all(self) -> None:
        """Queue a cancellation of every request in flight (its own completion is counted)."""
        tail = self._tail
        # opcode, flags, ioprio, fd, off, addr, len, cancel_flags, user_data; then
        # buf_index, personality, splice_fd_in, addr3, pad: all zero
        head = (IORING_OP_ASYNC_CANCEL, 0, 0, -1, 0, 0, 0, IORING_ASYNC_CANCEL_ANY)
        _SQE.pack_into(
            self._sqe_mm, (tail & self._sq_mask) * 64, *head, CANCEL_USER_DATA, 0, 0, 0, 0, 0
        )
        self._tail = (tail + 1) & 0xFFFFFFFF

    def _call(self, wait_nr: int, flags: int, arg: int | None, argsz: int) -> int:
        self._sq[self._sq_tail_i] = self._tail
        to_submit = (self._tail - self._sq[self._sq_head_i]) & 0xFFFFFFFF
        rc = _enter(SYS_IO_URING_ENTER, self.fd, to_submit, wait_nr, flags, arg, argsz)
        return rc if rc >= 0 else -ctypes.get_errno()

    def submit_and_wait(self, wait_nr: int) -> None:
        """Publish queued entries and wait until at least ``wait_nr`` completions are ready."""
        flags = IORING_ENTER_GETEVENTS if wait_nr else 0
        while True:
            rc = self._call(wait_nr, flags, None, 0)
            if rc >= 0:
                if wait_nr == 0 or self.ready() >= 1:
                    return
                continue
            if rc in (-errno.EINTR, -errno.EAGAIN, -errno.EBUSY):
                continue  # a signal (Ctrl-C is raised by the interpreter between calls)
            raise OSError(-rc, f"io_uring_enter: {os.strerror(-rc)}")

    def wait(self, timeout: float) -> int:
        """Submit what is queued and wait up to ``timeout`` s for one completion; returns the
        completions ready (0 on timeout or when a signal arrived)."""
        self._ts.tv_sec = int(timeout)
        self._ts.tv_nsec = int((timeout - int(timeout)) * 1e9)
        rc = self._call(
            1,
            IORING_ENTER_GETEVENTS | IORING_ENTER_EXT_ARG,
            self._arg_addr,
            ctypes.sizeof(self._arg),
        )
        if rc < 0 and rc not in (-errno.ETIME, -errno.EINTR, -errno.EAGAIN, -errno.EBUSY):
            raise OSError(-rc, f"io_uring_enter: {os.strerror(-rc)}")
        return self.ready()

    # -- completion ------------------------------------------------------------------------

    def ready(self) -> int:
        """Completions waiting to be reaped."""
        return (self._cq[self._cq_tail_i] - self._cq[self._cq_head_i]) & 0xFFFFFFFF

    def reap(self) -> list[tuple[int, int]]:
        """Take every ready completion as ``(user_data, result)``; result < 0 is ``-errno``."""
        cq = self._cq
        head = cq[self._cq_head_i]
        tail = cq[self._cq_tail_i]
        out = []
        mask = self._cq_mask
        mm = self._cq_mm
        base = self._cqes
        unpack = _CQE.unpack_from
        while head != tail:
            user_data, res, _flags = unpack(mm, base + (head & mask) * 16)
            out.append((user_data, res))
            head = (head + 1) & 0xFFFFFFFF
        cq[self._cq_head_i] = head  # one store: these no longer count as outstanding
        return out

    @property
    def outstanding(self) -> int:
        """Requests prepared (submitted or not) whose completion has not been reaped."""
        return (self._tail - self._cq[self._cq_head_i]) & 0xFFFFFFFF

    @property
    def dropped(self) -> int:
        """Submission entries the kernel dropped as invalid (must stay 0)."""
        return self._sq[self._sq_dropped_i]

    @property
    def overflow(self) -> int:
        """Completions lost to a full completion queue (must stay 0)."""
        return self._cq[self._cq_overflow_i]

    def check_counters(self) -> None:
        """Raise ``OSError`` if the kernel dropped a submission or a completion."""
        if self.dropped or self.overflow:
            raise OSError(
                errno.EIO,
                f"io_uring lost requests (SQ dropped {self.dropped}, CQ overflow "
                f"{self.overflow}); results of this run are incomplete",
            )

    def drain(
        self, timeout: float = 10.0, grace: float = 2.0, hurry: Callable[[], bool] | None = None
    ) -> bool:
        """Reap until nothing is outstanding; True when that happened.

        Waits up to ``timeout`` seconds (less once ``hurry()`` says so, e.g. a second Ctrl-C),
        then cancels what is left and waits up to ``grace`` more. False means some request may
        still be running: its buffer must stay mapped.
        """
        if self._closed:
            return False
        deadline = monotonic() + timeout
        cancelled = False
        try:
            while self.outstanding:
                now = monotonic()
                if not cancelled and (now >= deadline or (hurry is not None and hurry())):
                    if self.space() == 0:
                        self.submit_and_wait(0)
                    self.prep_cancel_all()
                    cancelled, deadline = True, now + grace
                elif cancelled and now >= deadline:
                    return False
                self.wait(max(0.001, min(0.1, deadline - now)))
                self.reap()
        except OSError:
            return False
        return True

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unmap the rings and close the ring (requests still in flight are the kernel's to
        cancel; the caller has drained them, or keeps their buffers mapped)."""
        if self._closed:
            return
        self._closed = True
        self._sq.release()
        self._cq.release()
        for mm in {id(m): m for m in (self._sq_mm, self._cq_mm, self._sqe_mm)}.values():
            mm.close()
        os.close(self.fd)


def ring_unavailable_reason() -> str | None:
    """``None`` when a ring can be created here, else why not (kernel, sysctl, seccomp)."""
    try:
        Ring(2).close()
    except RingUnsupported as e:
        return e.strerror
    except OSError as e:
        if e.errno == errno.ENOSYS:
            return "this kernel has no io_uring (io_uring_setup: ENOSYS)"
        if e.errno == errno.EPERM:
            return (
                "io_uring is disabled here (io_uring_setup: EPERM; "
                "see /proc/sys/kernel/io_uring_disabled or the container's seccomp profile)"
            )
        return f"io_uring_setup failed: {os_error_text(e)}"
    return None
