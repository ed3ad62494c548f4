"""Aligned read buffers.

O_DIRECT needs buffer addresses aligned to the device's memory alignment; anonymous ``mmap``
memory is page-aligned, which covers every alignment up to a page, and larger ones are met by
rounding each slot's stride up. Engines that hand raw addresses to the kernel (io_uring) need
those addresses, so the pool exposes both memoryviews and addresses.

The memory is private (``MAP_PRIVATE``: Python's default anonymous map is shared, i.e. shmem)
and, where the kernel offers transparent huge pages, aligned to a huge page and advised
``MADV_HUGEPAGE``. A request's buffer is then physically contiguous, so an O_DIRECT read of
1 MiB is one segment instead of 256 pages — more than a virtio disk's 254-segment limit,
which would split it in two.
"""

from __future__ import annotations

import ctypes
import mmap
from functools import cache
from pathlib import Path

from .linux import PAGE_SIZE

use_huge_pages = True
"""Switch for comparisons (the benchmark measures both); off = ordinary 4 KiB pages."""


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


@cache
def huge_page_size() -> int | None:
    """The transparent huge page size, or ``None`` when THP is off or absent."""
    base = Path("/sys/kernel/mm/transparent_hugepage")
    try:
        if "[never]" in (base / "enabled").read_text():
            return None
        size = int((base / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return None
    return size if size > PAGE_SIZE and hasattr(mmap, "MADV_HUGEPAGE") else None


IDLE_LIMIT = 64 << 20
"""Bytes of closed pools kept mapped for the next pool of the same shape (see ``BufferPool``)."""
_IDLE: list[tuple[tuple[int, bool], mmap.mmap]] = []  # oldest first


def _take_idle(key: tuple[int, bool]) -> mmap.mmap | None:
    for i in range(len(_IDLE) - 1, -1, -1):
        if _IDLE[i][0] == key:
            return _IDLE.pop(i)[1]
    return None


def _put_idle(key: tuple[int, bool], mm: mmap.mmap) -> None:
    if key[0] > IDLE_LIMIT:
        mm.close()
    else:
        _IDLE.append((key, mm))
    while sum(k[0] for k, _ in _IDLE) > IDLE_LIMIT:
        _IDLE.pop(0)[1].close()


def release_idle() -> None:
    """Unmap every pool kept for reuse."""
    while _IDLE:
        _IDLE.pop()[1].close()


class BufferPool:
    """``count`` buffers of ``size`` bytes, each starting at an address aligned to ``align``.

    Closing a pool keeps its memory (up to ``IDLE_LIMIT`` in all; ``release_idle`` frees it)
    for the next pool of the same shape, with the same physical pages. That saves the page
    faults, but mostly it keeps 4 KiB-page buffers physically contiguous where they were: the
    page allocator hands pages back last-freed-first, so a pool freed and made again gets its
    pages in reverse physical order — 256 segments per 1 MiB read instead of one — every
    other time.
    """

    def __init__(self, count: int, size: int, align: int = 1) -> None:
        align = max(align, 1)
        stride = round_up(max(size, 1), max(PAGE_SIZE, align))
        huge = huge_page_size() if use_huge_pages else None
        base_align = max(align, huge or 1)
        total = stride * count
        if huge:
            total = round_up(total, huge)
        extra = base_align if base_align > PAGE_SIZE else 0
        self.size = size
        self._key = (total + extra, huge is not None)
        self._closed = False
        mm = _take_idle(self._key)
        fresh = mm is None
        if mm is None:
            flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
            mm = mmap.mmap(-1, total + extra, flags=flags) if flags else mmap.mmap(-1, total)
        self._mm = mm
        self._anchor = ctypes.c_char.from_buffer(self._mm)
        base = ctypes.addressof(self._anchor)
        skip = (-base) % base_align if extra else 0
        if huge and fresh:
            try:
                self._mm.madvise(mmap.MADV_HUGEPAGE, skip, total)
            except OSError:
                pass  # only advice; ordinary pages work
        if fresh:
            # Touch every page now (THP allocation, compaction and zeroing happen here,
            # once), not in the first reads: callers time their reads, not the set-up.
            ctypes.memset(base + skip, 0, stride * count)
        whole = memoryview(self._mm)
        self.views: list[memoryview] = [
            whole[skip + i * stride : skip + i * stride + size] for i in range(count)
        ]
        self.addresses: list[int] = [base + skip + i * stride for i in range(count)]
        self._whole = whole

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Give the memory back (kept for reuse); no view may be used afterwards."""
        if self._closed:
            return
        self._closed = True
        for v in self.views:
            v.release()
        self.views = []
        self._whole.release()
        del self._anchor
        _put_idle(self._key, self._mm)

    def abandon(self) -> None:
        """Keep the memory mapped for the life of the process and never reuse it: a read the
        kernel could not finish or cancel may still write into it, and unmapping would let
        that write land in whatever is mapped at the same address next."""
        self._closed = True
        _ABANDONED.append(self)
        self.views = []


_ABANDONED: list[BufferPool] = []
