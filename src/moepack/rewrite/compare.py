"""Byte-range comparison between two files through two bounded buffers.

Reads with ``preadv`` into reusable buffers (nothing mapped, so RSS stays flat) and compares
eight bytes at a time with numpy; only when a range differs does it look for the exact offset.
"""

from __future__ import annotations

import os

import numpy as np

from .copy import PREFETCH, pread_exact

CHUNK = 16 * 1024 * 1024


def _equal(a: memoryview, b: memoryview) -> bool:
    n = len(a)
    head = n - n % 8
    if head and not np.array_equal(
        np.frombuffer(a[:head], np.uint64), np.frombuffer(b[:head], np.uint64)
    ):
        return False
    return bytes(a[head:]) == bytes(b[head:])


class RangeComparer:
    """Compares ranges of file A with ranges of file B; counts the bytes it compared."""

    def __init__(self) -> None:
        self._a = bytearray()
        self._b = bytearray()
        self.bytes_compared = 0
        self._plan: list[tuple[int, int, int]] = []
        self._advised = 0  # next entry of _plan to advise
        self._ahead = 0  # bytes advised but not yet read

    def expect(self, reads: list[tuple[int, int, int]]) -> None:
        """The ``(fd, offset, length)`` reads coming next, in order: they are announced to the
        kernel (``POSIX_FADV_WILLNEED``) about ``PREFETCH`` bytes ahead of the comparison, so
        slices read out of order keep the device busy."""
        self._plan = [
            (fd, o + k, min(CHUNK, n - k)) for fd, o, n in reads for k in range(0, n, CHUNK)
        ]
        self._advised = self._ahead = 0

    def _advise(self, consumed: int) -> None:
        self._ahead -= consumed
        while self._advised < len(self._plan) and self._ahead < PREFETCH:
            fd, off, n = self._plan[self._advised]
            os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
            self._ahead += n
            self._advised += 1

    def _read(self, fd: int, buf: bytearray, offset: int, n: int) -> memoryview:
        if len(buf) < n:  # grow on demand, up to CHUNK: small files stay cheap
            buf.extend(bytes(min(CHUNK, max(n, 2 * len(buf), 1 << 16)) - len(buf)))
        view = memoryview(buf)[:n]
        if self._plan:
            self._advise(n)
        pread_exact(fd, view, offset)
        return view

    def first_difference(
        self, fd_a: int, off_a: int, fd_b: int, off_b: int, length: int
    ) -> int | None:
        """Offset (from the range start) of the first differing byte, or None if equal."""
        done = 0
        while done < length:
            n = min(CHUNK, length - done)
            va = self._read(fd_a, self._a, off_a + done, n)
            vb = self._read(fd_b, self._b, off_b + done, n)
            self.bytes_compared += n
            if not _equal(va, vb):
                diff = np.flatnonzero(np.frombuffer(va, np.uint8) != np.frombuffer(vb, np.uint8))
                return done + int(diff[0])
            done += n
        return None

    def first_nonzero(self, fd: int, offset: int, length: int) -> int | None:
        """Offset of the first non-zero byte in the range, or None (padding check)."""
        done = 0
        while done < length:
            n = min(CHUNK, length - done)
            v = np.frombuffer(self._read(fd, self._a, offset + done, n), np.uint8)
            nz = np.flatnonzero(v)
            if len(nz):
                return done + int(nz[0])
            done += n
        return None

    def head(self, fd: int, offset: int, n: int) -> bytes:
        """The first ``n`` bytes at ``offset`` (for slice signatures)."""
        return bytes(self._read(fd, self._b, offset, n))
