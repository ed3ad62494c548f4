"""Announcing coming reads to the kernel from a thread of its own.

``posix_fadvise(POSIX_FADV_WILLNEED)`` submits the reads before it returns, and waits for room
whenever the device queue is full: made by the thread that copies or compares, it stalls that
thread for as long as the device is busy (a third of verify's time on a 2.3 GB model). Here a
helper thread makes the announcements, keeping about ``ahead`` bytes announced beyond what the
caller has consumed, so the caller only ever waits for data, never for the queue.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Sequence

Read = tuple[int, int, int]  # (fd, offset, length)


class ReadAhead:
    """Announces ``reads`` (in order) about ``ahead`` bytes beyond what ``consumed`` reports.

    A hint only: a read the kernel refuses to announce is simply read later. Use as a context
    manager, or call ``close`` before closing the descriptors (it waits for the thread)."""

    def __init__(self, reads: Sequence[Read], ahead: int) -> None:
        self._reads = reads
        self._ahead = ahead
        self._consumed = 0
        self._announced = 0
        self._stop = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        if reads and ahead > 0 and hasattr(os, "posix_fadvise"):
            self._thread = threading.Thread(target=self._run, name="moepack-readahead", daemon=True)
            self._thread.start()

    def consumed(self, n: int) -> None:
        """The caller has used ``n`` more bytes of the announced reads."""
        if self._thread is None:
            return
        with self._cond:
            self._consumed += n
            if self._announced - self._consumed < self._ahead:
                self._cond.notify()

    def _run(self) -> None:
        for fd, offset, length in self._reads:
            with self._cond:
                while not self._stop and self._announced - self._consumed >= self._ahead:
                    self._cond.wait()
                if self._stop:
                    return
            try:
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
            except OSError:
                return  # a descriptor that takes no hints: the reads still happen, unannounced
            with self._cond:
                self._announced += length

    def close(self) -> None:
        """Stop announcing and wait for the thread."""
        if self._thread is None:
            return
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()
        self._thread = None

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


WARM_BYTES = 256 * 1024 * 1024  # per file: about what the device reads while headers are parsed
WARM_STEP = 8 * 1024 * 1024


def warm_start(*paths: str | os.PathLike[str], length: int = WARM_BYTES) -> None:
    """Start reading the first ``length`` bytes of each file into the page cache, in the
    background, and return at once.

    Repack and verify spend their first half second parsing headers and fingerprinting
    (small reads that leave the device idle) before the bulk reads begin at the start of the
    data; this keeps the device busy meanwhile. Fire and forget: the thread opens and closes
    its own descriptors and ends when the reads are submitted; a file it cannot open is
    skipped (the caller reports it)."""
    if hasattr(os, "posix_fadvise") and length > 0:
        names = [os.fspath(p) for p in paths]
        threading.Thread(
            target=_warm, args=(names, length), name="moepack-warm", daemon=True
        ).start()


def _warm(paths: list[str], length: int) -> None:
    fds = []
    for p in paths:
        try:  # non-blocking: a FIFO given by mistake must not hold the thread
            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        if stat.S_ISREG(os.fstat(fd).st_mode):
            fds.append(fd)
        else:
            os.close(fd)
    try:
        for offset in range(0, length, WARM_STEP):  # interleaved: the files are read together
            for fd in fds:
                try:
                    os.posix_fadvise(fd, offset, WARM_STEP, os.POSIX_FADV_WILLNEED)
                except OSError:
                    return
    finally:
        for fd in fds:
            os.close(fd)
