"""Byte-range comparison between two files, reading ahead in parallel with bounded memory.

The caller announces the reads it will make (``expect``, in order); two worker threads read
them ahead into a small pool of reusable buffers (``preadv`` releases the GIL; nothing is
mapped, so RSS stays flat), so both files are read concurrently and the comparison of one
chunk overlaps the reading of the next ones. Comparison is libc's ``memcmp``; only when a range
differs does numpy look for the exact offset. A read nobody announced is made
on the spot.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

import numpy as np

from ..storage.copy import PREFETCH, pread_exact
from ..storage.linux import LIBC
from ..storage.readahead import ReadAhead

CHUNK = 4 * 1024 * 1024
AHEAD = 6 * CHUNK  # bytes read ahead into buffers (plus one buffer per side being compared)
READERS = 2
SMALL = 256 * 1024  # reads below this are made on the spot (a thread hand-off costs more)
SMALL_BUFFER = 64 * 1024

Side = Literal["a", "b"]
Read = tuple[int, int, int]  # (fd, offset, length)


_memcmp = LIBC.memcmp
_memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_memcmp.restype = ctypes.c_int


def _equal(a: bytearray, b: bytearray, n: int) -> bool:
    """The first ``n`` bytes of two buffers are equal: libc's memcmp, which ctypes calls
    without the GIL (the readers keep reading) and which makes no temporaries."""
    pa = ctypes.addressof(ctypes.c_char.from_buffer(a))
    pb = ctypes.addressof(ctypes.c_char.from_buffer(b))
    return _memcmp(pa, pb, n) == 0


def pair_reads(fd_a: int, off_a: int, fd_b: int, off_b: int, length: int) -> list[Read]:
    """The reads ``first_difference`` makes for one range pair, in the order it makes them."""
    out: list[Read] = []
    for k in range(0, length, CHUNK):
        n = min(CHUNK, length - k)
        out += [(fd_a, off_a + k, n), (fd_b, off_b + k, n)]
    return out


def single_reads(fd: int, offset: int, length: int) -> list[Read]:
    """The reads ``first_nonzero`` makes for one range, in order."""
    return [(fd, offset + k, min(CHUNK, length - k)) for k in range(0, length, CHUNK)]


def _first_in_chunks(length: int, find: Callable[[int, int], int | None]) -> int | None:
    """The first offset in ``length`` bytes that ``find(start, n)`` reports for the chunk of
    ``n <= CHUNK`` bytes at ``start`` (relative to the chunk), taken in order; None if none."""
    done = 0
    while done < length:
        n = min(CHUNK, length - done)
        at = find(done, n)
        if at is not None:
            return done + at
        done += n
    return None


def _read_into(fd: int, buf: bytearray, offset: int, n: int) -> None:
    pread_exact(fd, memoryview(buf)[:n], offset)


class RangeComparer:
    """Compares ranges of file A with ranges of file B; counts the bytes it compared.

    Use as a context manager (or call ``close``): it owns the reader threads."""

    def __init__(self, ahead: int = AHEAD, readers: int = READERS) -> None:
        self.bytes_compared = 0
        self._ahead_limit = ahead
        self._max_pending = max(1, ahead // CHUNK)
        self._pool: ThreadPoolExecutor | None = None
        self._readers = readers
        self._free: dict[int, list[bytearray]] = {}  # buffer size -> free buffers
        self._held: dict[Side, bytearray | None] = {"a": None, "b": None}
        self._plan: list[Read] = []
        self._next = 0  # next entry of _plan to submit
        self._hints: ReadAhead | None = None
        self._pending: dict[Read, tuple[Future[None], bytearray]] = {}
        self._in_flight = 0

    # ------------------------------------------------------------------ read-ahead
    def expect(self, reads: list[Read]) -> None:
        """The reads coming next, in the order they will be made (see ``pair_reads`` and
        ``single_reads``): read ahead by the workers, and announced to the kernel
        (``POSIX_FADV_WILLNEED``, from a thread of its own) about ``PREFETCH`` bytes further,
        so slices read out of order keep the device busy."""
        self._drain()
        self._plan = list(reads)
        self._next = 0
        self._hints = ReadAhead(self._plan, self._ahead_limit + PREFETCH)
        self._submit()

    def _submit(self) -> None:
        while (
            self._next < len(self._plan)
            and self._in_flight < self._ahead_limit
            and len(self._pending) < self._max_pending  # each read holds a buffer
        ):
            read = self._plan[self._next]
            self._next += 1
            if read in self._pending or read[2] < SMALL:  # small: read when asked, no hand-off
                continue
            buf = self._buffer(read[2])
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._readers, thread_name_prefix="moepack-read")
            self._pending[read] = (self._pool.submit(_read_into, read[0], buf, *read[1:]), buf)
            self._in_flight += read[2]

    def _buffer(self, n: int) -> bytearray:
        """A free buffer for ``n`` bytes from the pool of its size class (powers of two from
        64 KiB to CHUNK): small files stay cheap (a new buffer is zeroed), and buffers go back
        to their pool, so each pool holds at most the reads in flight plus two."""
        size = min(CHUNK, max(SMALL_BUFFER, 1 << (n - 1).bit_length()))
        pool = self._free.setdefault(size, [])
        return pool.pop() if pool else bytearray(size)

    def _release(self, buf: bytearray) -> None:
        self._free.setdefault(len(buf), []).append(buf)

    def _read(self, fd: int, side: Side, offset: int, n: int) -> memoryview:
        """``n`` bytes at ``offset``, valid until the next read on the same ``side``."""
        old = self._held[side]
        if old is not None:
            self._release(old)
        key = (fd, offset, n)
        got = self._pending.pop(key, None)
        if got is not None:
            future, buf = got
            self._in_flight -= n
            future.result()
        else:
            buf = self._buffer(n)
            _read_into(fd, buf, offset, n)
        self._held[side] = buf
        if self._hints is not None:
            self._hints.consumed(n)
        self._submit()
        return memoryview(buf)[:n]

    def _held_buffer(self, side: Side) -> bytearray:
        buf = self._held[side]
        assert buf is not None, "read before compare"
        return buf

    def _drain(self) -> None:
        if self._hints is not None:
            self._hints.close()
            self._hints = None
        for future, buf in self._pending.values():
            future.cancel()
            try:
                future.result()
            except Exception:  # noqa: BLE001 - a read-ahead nobody will use
                pass
            self._release(buf)
        self._pending.clear()
        self._in_flight = 0

    def close(self) -> None:
        """Stop the readers (reads ahead that are no longer needed are dropped)."""
        self._drain()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> RangeComparer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ comparisons
    def first_difference(
        self, fd_a: int, off_a: int, fd_b: int, off_b: int, length: int
    ) -> int | None:
        """Offset (from the range start) of the first differing byte, or None if equal."""
        return _first_in_chunks(
            length, lambda at, n: self._chunk_difference(fd_a, off_a + at, fd_b, off_b + at, n)
        )

    def first_nonzero(self, fd: int, offset: int, length: int) -> int | None:
        """Offset of the first non-zero byte in the range, or None (padding check)."""
        return _first_in_chunks(length, lambda at, n: self._chunk_nonzero(fd, offset + at, n))

    def _chunk_difference(self, fd_a: int, off_a: int, fd_b: int, off_b: int, n: int) -> int | None:
        """``first_difference`` of one chunk of at most ``CHUNK`` bytes, read into buffers."""
        va = self._read(fd_a, "a", off_a, n)
        vb = self._read(fd_b, "b", off_b, n)
        self.bytes_compared += n
        if _equal(self._held_buffer("a"), self._held_buffer("b"), n):
            return None
        return int(np.flatnonzero(np.frombuffer(va, np.uint8) != np.frombuffer(vb, np.uint8))[0])

    def _chunk_nonzero(self, fd: int, offset: int, n: int) -> int | None:
        """``first_nonzero`` of one chunk of at most ``CHUNK`` bytes, read into a buffer."""
        nz = np.flatnonzero(np.frombuffer(self._read(fd, "a", offset, n), np.uint8))
        return int(nz[0]) if len(nz) else None

    def head(self, fd: int, offset: int, n: int) -> bytes:
        """``n`` bytes at ``offset`` (for slice signatures; ``n`` may exceed ``CHUNK``)."""
        out = bytearray()
        for k in range(0, n, CHUNK):
            out += self._read(fd, "b", offset + k, min(CHUNK, n - k))
        return bytes(out)
