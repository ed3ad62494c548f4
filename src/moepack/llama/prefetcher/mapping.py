"""llama.cpp's own mapping of the model, from inside its process: no read-around on the
expert ranges, and eviction of the model's pages for a cold start.

A page fault on a file mapping reads a window around the faulting page (``read_ahead_kb`` of
the device, 8 MiB on some virtual disks): on expert bytes that is mostly other experts, which
evicts what the next layer needs. ``MADV_RANDOM`` on those ranges makes a fault read only
the page. llama.cpp maps each GGUF whole, from offset 0, so the mapping is found in
``/proc/self/maps`` by the file's device and inode.

Eviction drops only this file's pages: ``MADV_DONTNEED`` unmaps them from llama.cpp's mapping
(a mapped page cannot leave the page cache), then ``POSIX_FADV_DONTNEED`` drops them. Nothing
machine-wide is touched.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from pathlib import Path

from ...pages import drop_cached
from ...storage.linux import LIBC, PAGE_SIZE, cachestat
from .prefetch import FileRange

_libc = LIBC


def file_mappings(path: Path) -> list[tuple[int, int, int]]:
    """``(start, end, file_offset)`` of every mapping of ``path`` in this process."""
    st = os.stat(path)
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 5:
            continue
        span, _perms, offset, dev, inode = parts[:5]
        if int(inode) != st.st_ino:
            continue
        major, minor = (int(x, 16) for x in dev.split(":"))
        if os.makedev(major, minor) != st.st_dev:
            continue
        start, end = (int(x, 16) for x in span.split("-"))
        out.append((start, end, int(offset, 16)))
    return out


def no_readaround(paths: Sequence[Path], ranges: Sequence[FileRange]) -> int:
    """``MADV_RANDOM`` on ``ranges`` (of shard ``paths``) wherever this process maps them;
    returns the bytes advised (0 when the model is not mapped here)."""
    advised = 0
    maps = [file_mappings(p) for p in paths]
    for r in ranges:
        for start, end, foff in maps[r.shard]:
            lo = max(r.offset, foff)
            hi = min(r.end, foff + (end - start))
            if lo >= hi:
                continue
            a0 = (start + lo - foff) // PAGE_SIZE * PAGE_SIZE
            if _libc.madvise(a0, start + hi - foff - a0, mmap.MADV_RANDOM) == 0:
                advised += hi - lo
    return advised


def evict(paths: Sequence[Path]) -> int:
    """Drop every page of these files from this process's mappings and the page cache;
    returns the bytes still cached afterwards (pages another process maps or locks stay)."""
    left = 0
    for path in paths:
        for start, end, _foff in file_mappings(path):
            _libc.madvise(start, end - start, mmap.MADV_DONTNEED)
        fd = os.open(path, os.O_RDONLY)
        try:
            drop_cached(fd)
            left += cachestat(fd, 0, 0).nr_cache * PAGE_SIZE
        finally:
            os.close(fd)
    return left
