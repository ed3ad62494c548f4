"""Start writing a copy's pages to disk while the copy is still reading.

A file written through the page cache stays dirty until the final ``fsync`` (below the
kernel's background threshold nothing is written early), so read-everything-then-write-
everything is what ``cp`` + ``sync`` does. ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` starts
writeback of what has been written so far without waiting for it, so the device writes the
output while the copy reads the input; the final ``fsync`` still makes it durable.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import Future, ThreadPoolExecutor

from .linux import LIBC

SYNC_FILE_RANGE_WRITE = 2
STEP = 32 * 1024 * 1024  # start writeback every this many bytes written


def _libc_sync_file_range() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    fn = getattr(LIBC, "sync_file_range", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()


class Writeback:
    """Tracks bytes written to ``fd`` and starts their writeback every ``step`` bytes, from a
    thread of its own: submitting writeback can wait for room in the device queue, and the
    copy must not wait with it. Use as a context manager (``close`` waits for that thread)."""

    def __init__(self, fd: int, step: int = STEP) -> None:
        self.fd = fd
        self.step = step
        self._pending = 0
        self._enabled = _SYNC_FILE_RANGE is not None
        self._pool: ThreadPoolExecutor | None = None
        self._running: Future[None] | None = None

    def wrote(self, n: int) -> None:
        """``n`` more bytes were written; every ``step`` bytes, start writing them back."""
        self._pending += n
        if self._pending >= self.step and self._enabled:
            if self._running is not None and not self._running.done():
                return  # still submitting the last batch: the next call takes these too
            self._pending = 0
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="moepack-writeback")
            self._running = self._pool.submit(self._start)

    def _start(self) -> None:
        fn = _SYNC_FILE_RANGE
        if fn is not None and fn(self.fd, 0, 0, SYNC_FILE_RANGE_WRITE) != 0:
            self._enabled = False  # not supported for this file: the final fsync does it

    def close(self) -> None:
        """Wait for the writeback thread (the descriptor may be closed after this)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> Writeback:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
