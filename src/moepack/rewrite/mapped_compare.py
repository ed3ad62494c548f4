"""Comparing byte ranges of two files in place, in their memory maps.

``RangeComparer`` reads both files into buffers: every byte is copied once from the page
cache before ``memcmp`` reads it again. Here the files are mapped read-only and compared where
the kernel put them, so that copy disappears (about a fifth of verify's CPU time, measured
with the pages cached). Helper threads fault the announced ranges in ahead of the comparison with
``MADV_POPULATE_READ`` (one call maps a whole range and starts its reads; ctypes releases the
GIL meanwhile), and each compared range is released at once (``MADV_DONTNEED``), so the
resident set stays bounded by the look-ahead whatever the file size.

A range is touched only after ``MADV_POPULATE_READ`` succeeded on it and while the file still
has the size it was mapped with (checked with ``fstat`` before every range): past the end of a
file that shrank, populate fails where a plain access would raise SIGBUS, and the range is
then read with ``preadv`` as ``RangeComparer`` does (which names the byte where the file
ended). What remains is the instant between that check and the access, the same as for any
memory map of a file (gguf-py's included).
Where mapping is unavailable (no ``MADV_POPULATE_READ`` before Linux 5.14, a file that cannot
be mapped) every read takes that path.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..storage.copy import PREFETCH
from ..storage.linux import LIBC, MAP_FAILED
from ..storage.readahead import ReadAhead
from .compare import CHUNK, RangeComparer, Read, Side, _memcmp

MAPPED_AHEAD = 4 * CHUNK  # bytes faulted in ahead of the comparison (both files together)
POPULATORS = 2
MADV_POPULATE_READ = 22  # Linux 5.14+
PAGE = mmap.PAGESIZE
FAULT_AROUND = 256 * 1024  # above the kernel's fault_around_bytes (64 KiB by default)

_mmap, _munmap, _madvise = LIBC.mmap, LIBC.munmap, LIBC.madvise  # declared in storage.linux
_MAP_FAILED = MAP_FAILED


@dataclass
class _Map:
    address: int
    size: int
    identity: tuple[int, int]  # (st_dev, st_ino): a descriptor number may be reused


def _pages(address: int, n: int) -> tuple[int, int]:
    """The page-aligned span holding ``[address, address + n)``."""
    lo = address // PAGE * PAGE
    return lo, -(-(address + n) // PAGE) * PAGE - lo


def _populate(address: int, n: int) -> bool:
    """Fault ``n`` bytes at ``address`` in (reading them if needed); False if the kernel
    refused (past the end of the file, or no ``MADV_POPULATE_READ`` here)."""
    lo, span = _pages(address, n)
    return _madvise(lo, span, MADV_POPULATE_READ) == 0


def _at(address: int, n: int) -> np.ndarray:
    """The ``n`` bytes at ``address`` as a numpy array (no copy)."""
    return np.frombuffer(memoryview((ctypes.c_uint8 * n).from_address(address)).cast("B"), np.uint8)


class MappedComparer(RangeComparer):
    """``RangeComparer`` with the same answers, comparing in the files' memory maps.

    Use as a context manager (or call ``close``): it owns the helper threads and the maps."""

    def __init__(self, ahead: int = MAPPED_AHEAD, populators: int = POPULATORS) -> None:
        super().__init__()
        self._maps: dict[int, _Map | None] = {}
        self._retired: list[_Map] = []  # maps of files that changed size since
        self._pop_limit = ahead
        self._populators = populators
        self._pop_pool: ThreadPoolExecutor | None = None
        self._pop_plan: list[Read] = []
        self._pop_next = 0
        self._pop_pending: dict[Read, Future[bool]] = {}
        self._pop_bytes = 0
        self._mapped_held: dict[Side, tuple[int, int] | None] = {"a": None, "b": None}
        self._zeros: bytearray | None = None
        self._usable = True  # False once the kernel turns out to lack MADV_POPULATE_READ

    # ------------------------------------------------------------------ maps
    def _map(self, fd: int) -> _Map | None:
        st = os.fstat(fd)
        m = self._maps.get(fd)
        if m is not None and m.identity == (st.st_dev, st.st_ino) and m.size == st.st_size:
            return m  # a file that changed size is mapped afresh: no range past its end is used
        if m is not None:  # unmapped at close: an address taken from it may still be in use
            self._retired.append(m)
        if not self._usable or st.st_size == 0:
            self._maps[fd] = None
            return None
        address = _mmap(None, st.st_size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address is None or address == _MAP_FAILED:
            self._maps[fd] = None
            return None
        self._maps[fd] = m = _Map(address, st.st_size, (st.st_dev, st.st_ino))
        return m

    def _address(self, fd: int, offset: int, n: int) -> int | None:
        """Where ``n`` bytes at ``offset`` sit in the map, if they lie inside it."""
        m = self._map(fd) if self._usable else None
        if m is None or offset < 0 or offset + n > m.size:
            return None
        return m.address + offset

    # ------------------------------------------------------------------ faulting in ahead
    def expect(self, reads: list[Read]) -> None:
        """The reads coming next, in order: faulted in ahead by the helper threads."""
        self._drain_populate()
        self._pop_plan = list(reads)
        self._pop_next = 0
        # beyond the mapped look-ahead, the kernel hears of the reads further on (page cache
        # only, not resident in this process): the device gets depth without the RSS
        self._hints = ReadAhead(self._pop_plan, self._pop_limit + PREFETCH)
        self._pop_submit()

    def _pop_submit(self) -> None:
        while self._pop_next < len(self._pop_plan) and self._pop_bytes < self._pop_limit:
            read = self._pop_plan[self._pop_next]
            self._pop_next += 1
            fd, offset, n = read
            address = self._address(fd, offset, n)
            if address is None or read in self._pop_pending:
                continue
            if self._pop_pool is None:
                self._pop_pool = ThreadPoolExecutor(
                    self._populators, thread_name_prefix="moepack-read-map"
                )
            self._pop_pending[read] = self._pop_pool.submit(_populate, address, n)
            self._pop_bytes += n

    def _drain_populate(self) -> None:
        if self._hints is not None:
            self._hints.close()
            self._hints = None
        for future in self._pop_pending.values():
            future.cancel()
            try:
                future.result()
            except Exception:  # noqa: BLE001 - a look-ahead nobody will use
                pass
        self._pop_pending.clear()
        self._pop_bytes = 0

    def _mapped(self, fd: int, side: Side, offset: int, n: int) -> int | None:
        """The address of ``n`` bytes at ``offset``, faulted in and valid until the next read
        on ``side``; None when they must be read instead (see the module docstring)."""
        held = self._mapped_held[side]
        if held is not None:
            _madvise(*held, mmap.MADV_DONTNEED)
            self._mapped_held[side] = None
        if self._hints is not None:
            self._hints.consumed(n)
        key = (fd, offset, n)
        future = self._pop_pending.pop(key, None)
        ok = False
        if future is not None:
            self._pop_bytes -= n
            ok = future.result()
        address = self._address(fd, offset, n)  # None if the file is now shorter (see _map)
        if address is not None and not ok:
            ok = _populate(address, n)  # not announced: fault in here
            if not ok and ctypes.get_errno() == errno.EINVAL:  # no MADV_POPULATE_READ here
                self._usable = False
        self._pop_submit()
        if address is None or not ok:
            return None
        m = self._maps[fd]
        assert m is not None
        # fault-around maps neighbouring cached pages too: release them with the range, or
        # they stay resident, a few per range, growing with the file
        lo, span = _pages(address, n)
        start = max(m.address, lo - FAULT_AROUND)
        end = min(m.address + -(-m.size // PAGE) * PAGE, lo + span + FAULT_AROUND)
        self._mapped_held[side] = (start, end - start)
        return address

    # ------------------------------------------------------------------ comparisons
    def _chunk_difference(self, fd_a: int, off_a: int, fd_b: int, off_b: int, n: int) -> int | None:
        """One chunk compared in place in both maps (read into buffers where either side
        cannot be mapped: the same answer, slower)."""
        pa = self._mapped(fd_a, "a", off_a, n)
        pb = self._mapped(fd_b, "b", off_b, n)
        if pa is None or pb is None:
            return super()._chunk_difference(fd_a, off_a, fd_b, off_b, n)
        self.bytes_compared += n
        if _memcmp(pa, pb, n) == 0:
            return None
        return int(np.flatnonzero(_at(pa, n) != _at(pb, n))[0])

    def _chunk_nonzero(self, fd: int, offset: int, n: int) -> int | None:
        """One chunk checked in place in the map against a buffer of zeros."""
        p = self._mapped(fd, "a", offset, n)
        if p is None:
            return super()._chunk_nonzero(fd, offset, n)
        if self._zeros is None or len(self._zeros) < n:
            self._zeros = bytearray(CHUNK)
        zeros = ctypes.addressof(ctypes.c_char.from_buffer(self._zeros))
        if _memcmp(p, zeros, n) == 0:
            return None
        return int(np.flatnonzero(_at(p, n))[0])

    def close(self) -> None:
        """Stop the helper threads, then unmap the files."""
        self._drain_populate()
        if self._pop_pool is not None:
            self._pop_pool.shutdown(wait=True, cancel_futures=True)
            self._pop_pool = None
        for m in [*self._maps.values(), *self._retired]:
            if m is not None:
                _munmap(m.address, m.size)
        self._maps.clear()
        self._retired.clear()
        self._mapped_held = {"a": None, "b": None}
        super().close()
