"""Announcing coming reads to the kernel from a thread of its own.

``posix_fadvise(POSIX_FADV_WILLNEED)`` submits the reads before it returns, and waits for room
whenever the device queue is full: made by the thread that copies or compares, it stalls that
thread for as long as the device is busy (a third of verify's time on a 2.3 GB model). Here a
helper thread makes the announcements, keeping about ``ahead`` bytes announced beyond what the
caller has consumed, so the caller only ever waits for data, never for the queue.
"""

from __future__ import annotations

import os
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
