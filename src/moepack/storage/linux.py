"""The few Linux calls Python's ``os`` module lacks, through ctypes.

``statx`` (for the O_DIRECT alignment a file needs), ``cachestat`` (how much of a file sits in
the page cache) and the ``RWF_DONTCACHE`` read flag. Each wrapper returns ``None`` (or raises
``OSError``) where the kernel or C library lacks the call, so callers can say why and go on.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
from dataclasses import dataclass

RWF_DONTCACHE = 0x80
"""preadv2 flag (Linux 6.14+): a buffered read whose pages are dropped once copied out.
Python has no constant for it yet; the value is fixed by the kernel's uapi."""

# cachestat, io_uring_setup and io_uring_enter have one number on every architecture
# (they were added after the syscall tables were unified).
SYS_CACHESTAT = 451
SYS_IO_URING_SETUP = 425
SYS_IO_URING_ENTER = 426

STATX_DIOALIGN = 0x2000
AT_FDCWD = -100
PAGE_SIZE = mmap.PAGESIZE

LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
"""The C library, loaded once for every module that calls it (errno kept for each call)."""
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
LIBC.munmap.restype = ctypes.c_int
LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
LIBC.madvise.restype = ctypes.c_int
LIBC.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
LIBC.mlock.restype = ctypes.c_int
MAP_FAILED = ctypes.c_void_p(-1).value
"""What ``mmap`` returns on failure."""
_syscall = LIBC.syscall
_syscall.restype = ctypes.c_long


def syscall(number: int, *args: object) -> int:
    """Call a raw syscall; raise ``OSError`` with the kernel's errno on failure."""
    rc = _syscall(ctypes.c_long(number), *args)
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return rc


class _StatxTimestamp(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_int64), ("tv_nsec", ctypes.c_uint32), ("_r", ctypes.c_int32)]


class _Statx(ctypes.Structure):
    _fields_ = [
        ("stx_mask", ctypes.c_uint32),
        ("stx_blksize", ctypes.c_uint32),
        ("stx_attributes", ctypes.c_uint64),
        ("stx_nlink", ctypes.c_uint32),
        ("stx_uid", ctypes.c_uint32),
        ("stx_gid", ctypes.c_uint32),
        ("stx_mode", ctypes.c_uint16),
        ("_spare0", ctypes.c_uint16),
        ("stx_ino", ctypes.c_uint64),
        ("stx_size", ctypes.c_uint64),
        ("stx_blocks", ctypes.c_uint64),
        ("stx_attributes_mask", ctypes.c_uint64),
        ("stx_atime", _StatxTimestamp),
        ("stx_btime", _StatxTimestamp),
        ("stx_ctime", _StatxTimestamp),
        ("stx_mtime", _StatxTimestamp),
        ("stx_rdev_major", ctypes.c_uint32),
        ("stx_rdev_minor", ctypes.c_uint32),
        ("stx_dev_major", ctypes.c_uint32),
        ("stx_dev_minor", ctypes.c_uint32),
        ("stx_mnt_id", ctypes.c_uint64),
        ("stx_dio_mem_align", ctypes.c_uint32),
        ("stx_dio_offset_align", ctypes.c_uint32),
        ("_spare3", ctypes.c_uint64 * 12),
    ]


@dataclass(frozen=True)
class DioAlign:
    """What O_DIRECT needs for one file: buffer address and offset/length alignment."""

    mem: int
    offset: int
    source: str  # "statx" or "block device"


def statx_dio_align(path: str | os.PathLike[str]) -> DioAlign | None:
    """O_DIRECT alignment from statx(STATX_DIOALIGN) (Linux 6.1+).

    Returns ``None`` when the kernel or C library cannot say. A result with ``offset == 0``
    means the filesystem reports that this file does not support O_DIRECT at all.
    """
    fn = getattr(LIBC, "statx", None)
    if fn is None:
        return None
    buf = _Statx()
    rc = fn(
        ctypes.c_int(AT_FDCWD),
        os.fsencode(os.fspath(path)),
        ctypes.c_int(0),
        ctypes.c_uint(STATX_DIOALIGN),
        ctypes.byref(buf),
    )
    if rc != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EINVAL):
            return None
        raise OSError(err, os.strerror(err), os.fspath(path))
    if not buf.stx_mask & STATX_DIOALIGN:
        return None
    return DioAlign(int(buf.stx_dio_mem_align), int(buf.stx_dio_offset_align), "statx")


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [
        ("nr_cache", ctypes.c_uint64),
        ("nr_dirty", ctypes.c_uint64),
        ("nr_writeback", ctypes.c_uint64),
        ("nr_evicted", ctypes.c_uint64),
        ("nr_recently_evicted", ctypes.c_uint64),
    ]


@dataclass(frozen=True)
class CacheStat:
    """Page-cache state of a file range, in pages (cachestat(2))."""

    nr_cache: int
    nr_dirty: int
    nr_writeback: int
    nr_evicted: int
    nr_recently_evicted: int


def cachestat(fd: int, offset: int = 0, length: int = 0) -> CacheStat:
    """Page-cache residency of ``[offset, offset+length)`` (length 0 = to the end).

    Raises ``OSError`` (ENOSYS before Linux 6.5, EOPNOTSUPP on some filesystems).
    """
    rng = _CachestatRange(offset, length)
    cs = _Cachestat()
    syscall(SYS_CACHESTAT, ctypes.c_int(fd), ctypes.byref(rng), ctypes.byref(cs), ctypes.c_uint(0))
    return CacheStat(
        int(cs.nr_cache),
        int(cs.nr_dirty),
        int(cs.nr_writeback),
        int(cs.nr_evicted),
        int(cs.nr_recently_evicted),
    )


def advise_random(fd: int) -> None:
    """Turn off readahead for this descriptor, as fio does for random reads."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)


def resident_ranges(fd: int, size: int, max_chunks: int = 65536) -> list[tuple[int, int]]:
    """Byte ranges of the file that sit in the page cache, at a coarse grain (1 MiB or more,
    at most ``max_chunks`` cachestat calls); ``[]`` when cachestat is missing."""
    if size <= 0:
        return []
    chunk = max(1 << 20, -(-size // max_chunks))
    chunk = -(-chunk // PAGE_SIZE) * PAGE_SIZE
    out: list[tuple[int, int]] = []
    try:
        for off in range(0, size, chunk):
            n = min(chunk, size - off)
            cs = cachestat(fd, off, n)
            if cs.nr_cache * PAGE_SIZE * 2 >= n:  # mostly cached: worth reading back
                if out and out[-1][0] + out[-1][1] == off:
                    out[-1] = (out[-1][0], out[-1][1] + n)
                else:
                    out.append((off, n))
    except OSError:
        return []
    return out


def will_need(fd: int, ranges: list[tuple[int, int]]) -> int:
    """Ask the kernel to read ``ranges`` back into the page cache in the background
    (POSIX_FADV_WILLNEED); returns the bytes asked for."""
    asked = 0
    for off, n in ranges:
        try:
            os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
            asked += n
        except OSError:
            break
    return asked


def mem_available() -> int:
    """The memory this process could be given without swapping, in bytes: ``MemAvailable`` of
    ``/proc/meminfo`` (page cache included), or less where this process's memory cgroup
    (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) leaves less; 0 where neither can be
    read. A container's limit is what an out-of-memory kill enforces, not the machine's."""
    machine = _meminfo_available()
    limit = cgroup_headroom()
    if limit is None:
        return machine
    return min(machine, limit) if machine else limit


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


_CGROUP_ROOT = "/sys/fs/cgroup"


def cgroup_headroom(root: str = _CGROUP_ROOT, proc: str = "/proc/self/cgroup") -> int | None:
    """What this process's memory cgroup still lets it take (its limit less its usage, the
    cgroup's file pages counted as free, as the kernel reclaims them before it kills), or
    None where no limit applies or none can be read."""
    try:
        with open(proc, encoding="ascii") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _h, controllers, path = parts
        rel = path.lstrip("/")
        if controllers == "":  # v2: the unified hierarchy
            base = os.path.join(root, rel)
            room = _headroom(base, "memory.max", "memory.current", ("file",))
        elif "memory" in controllers.split(","):  # v1
            base = os.path.join(root, "memory", rel)
            room = _headroom(
                base,
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                ("total_inactive_file", "total_active_file"),
            )
        else:
            continue
        if room is not None:
            return room
    return None


_NO_LIMIT = 1 << 60  # v1 writes "no limit" as a page-rounded LONG_MAX


def _headroom(
    base: str, limit_name: str, usage_name: str, file_keys: tuple[str, ...]
) -> int | None:
    try:
        with open(os.path.join(base, limit_name), encoding="ascii") as fh:
            text = fh.read().strip()
        if text == "max" or int(text) >= _NO_LIMIT:
            return None
        limit = int(text)
        with open(os.path.join(base, usage_name), encoding="ascii") as fh:
            usage = int(fh.read().strip())
        reclaimable = 0
        with open(os.path.join(base, "memory.stat"), encoding="ascii") as fh:
            for line in fh:
                key, _, value = line.partition(" ")
                if key in file_keys:
                    reclaimable += int(value)
    except (OSError, ValueError):
        return None
    return max(0, limit - usage + reclaimable)
