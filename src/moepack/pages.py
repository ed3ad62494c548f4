"""Letting go of file pages: the one place moepack asks the kernel to drop them.

Two kinds of pages matter when streaming through files larger than memory:

* pages of a memory map this process has touched count towards its resident set until they
  are released (``MADV_DONTNEED``). Every map moepack releases is a read-only map of a file,
  so a released page that is read again simply faults back in from the page cache: releasing
  is always safe, only ever a cost in time;
* a file's pages in the kernel's page cache (``POSIX_FADV_DONTNEED``): clean pages are
  dropped, dirty ones are not (write them back first). Measurements use this to start cold,
  writers to keep their output from filling the cache.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from functools import partial

PAGE = mmap.PAGESIZE


def release_mapped(mm: mmap.mmap | None, start: int, end: int) -> None:
    """Release this process's pages of the read-only map ``mm`` that hold any of the bytes
    ``[start, end)``. Best effort: a platform without ``madvise`` keeps the pages."""
    if mm is None or not hasattr(mm, "madvise"):
        return
    lo = start // PAGE * PAGE
    hi = min(len(mm), -(-end // PAGE) * PAGE)
    if hi > lo:
        try:
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (OSError, ValueError):  # a closed map, or a kernel that refuses: keep them
            pass


def mapped_releaser(mm: mmap.mmap | None) -> Callable[[int, int], None] | None:
    """``release(start, end)`` for ``mm``, for code that streams through a map in steps;
    None when there is no map to release."""
    return None if mm is None else partial(release_mapped, mm)


def drop_cached(fd: int, offset: int = 0, length: int = 0) -> None:
    """Ask the kernel to drop the file's clean cached pages of ``[offset, offset + length)``
    (length 0: to the end). Raises ``OSError`` as ``posix_fadvise`` does; a platform without
    it keeps its cache."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
