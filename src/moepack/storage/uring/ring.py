"""A minimal io_uring over the raw syscalls, through ctypes.

Why not a binding: on this project's machines PyPI ``liburing`` dies with SIGILL when a ring is
created and ``pyuring`` does not build (see ``bindings.py`` and ``docs/storage.md``). Reads
need very little of io_uring — set up a ring, put READ entries in the submission queue, enter,
reap completions — so this module does exactly that with ``io_uring_setup`` (425) and
``io_uring_enter`` (426) and the SQ/CQ rings mapped with ``mmap``. No C code runs but the
kernel's, so nothing here can die of an instruction this CPU lacks.

Memory ordering: the kernel publishes a completion before moving the CQ tail, and this code
reads the tail only after ``io_uring_enter`` has returned (a full barrier); SQ entries are
written before the SQ tail is stored and published to the kernel by the next enter call.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import struct

from ..linux import SYS_IO_URING_ENTER, SYS_IO_URING_SETUP, _libc, _syscall

IORING_OFF_SQ_RING = 0
IORING_OFF_CQ_RING = 0x8000000
IORING_OFF_SQES = 0x10000000
IORING_FEAT_SINGLE_MMAP = 1 << 0
IORING_SETUP_CQSIZE = 1 << 3
IORING_SETUP_SUBMIT_ALL = 1 << 7
IORING_SETUP_COOP_TASKRUN = 1 << 8
IORING_SETUP_SINGLE_ISSUER = 1 << 12
IORING_SETUP_DEFER_TASKRUN = 1 << 13
IORING_ENTER_GETEVENTS = 1 << 0
IORING_OP_READ = 22

_SQE = struct.Struct("<BBHiQQIIQHHiQQ")  # struct io_uring_sqe, 64 bytes
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
)(("syscall", _libc))


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


assert ctypes.sizeof(_Params) == 120

# Set-up flags tried in order: the later kernels' "completions only when I ask" modes cut
# wake-ups for a single-threaded submitter; older kernels fall back to a plain ring.
_FLAG_CHOICES = (
    IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN,
    IORING_SETUP_COOP_TASKRUN,
    0,
)


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
    """One io_uring instance for reads: ``prep_read`` entries, ``submit_and_wait``, ``reap``."""

    def __init__(self, entries: int) -> None:
        entries = 1 << max(0, (max(entries, 1) - 1).bit_length())
        last: OSError | None = None
        for flags in _FLAG_CHOICES:
            try:
                fd, p = _setup(entries, flags)
                break
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                last = e
        else:
            assert last is not None
            raise last
        self.fd = fd
        self.flags = p.flags
        self.entries = p.sq_entries
        try:
            self._map(p)
        except BaseException:
            os.close(fd)
            raise
        self._tail = self._sq[self._sq_tail_i]
        self._closed = False

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
        self._sq_mask = self._sq[p.sq_off.ring_mask // 4]
        self._cq_head_i = p.cq_off.head // 4
        self._cq_tail_i = p.cq_off.tail // 4
        self._cq_mask = self._cq[p.cq_off.ring_mask // 4]
        self._cqes = p.cq_off.cqes
        array_i = p.sq_off.array // 4
        for i in range(p.sq_entries):  # SQ index array: slot i holds SQE i, once and for all
            self._sq[array_i + i] = i

    def space(self) -> int:
        """Free submission slots."""
        return self.entries - ((self._tail - self._sq[self._sq_head_i]) & 0xFFFFFFFF)

    def prep_read(
        self, fd: int, addr: int, length: int, offset: int, rw_flags: int, user_data: int
    ) -> None:
        """Queue one read of ``length`` bytes at ``offset`` into memory at ``addr``."""
        tail = self._tail
        _SQE.pack_into(
            self._sqe_mm,
            (tail & self._sq_mask) * 64,
            IORING_OP_READ, 0, 0, fd, offset, addr, length, rw_flags, user_data, 0, 0, 0, 0, 0,
        )  # fmt: skip
        self._tail = (tail + 1) & 0xFFFFFFFF

    def submit_and_wait(self, wait_nr: int) -> None:
        """Publish queued entries and wait until at least ``wait_nr`` completions are ready."""
        self._sq[self._sq_tail_i] = self._tail
        while True:
            to_submit = (self._tail - self._sq[self._sq_head_i]) & 0xFFFFFFFF
            rc = _enter(
                SYS_IO_URING_ENTER,
                self.fd,
                to_submit,
                wait_nr,
                IORING_ENTER_GETEVENTS if wait_nr else 0,
                None,
                0,
            )
            if rc >= 0:
                if wait_nr == 0 or self.ready() >= min(wait_nr, 1):
                    return
                continue
            err = ctypes.get_errno()
            if err in (errno.EINTR, errno.EAGAIN, errno.EBUSY):
                continue  # a signal (Ctrl-C is raised by the interpreter between calls)
            raise OSError(err, f"io_uring_enter: {os.strerror(err)}")

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
        cq[self._cq_head_i] = head
        return out

    def close(self) -> None:
        """Unmap the rings and close the ring (the caller has reaped every read in flight)."""
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
    except OSError as e:
        if e.errno == errno.ENOSYS:
            return "this kernel has no io_uring (io_uring_setup: ENOSYS)"
        if e.errno == errno.EPERM:
            return (
                "io_uring is disabled here (io_uring_setup: EPERM; "
                "see /proc/sys/kernel/io_uring_disabled or the container's seccomp profile)"
            )
        return f"io_uring_setup failed: {e.strerror}"
    return None
