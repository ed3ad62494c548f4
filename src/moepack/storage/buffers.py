"""Aligned read buffers.

O_DIRECT needs buffer addresses aligned to the device's memory alignment; anonymous ``mmap``
memory is page-aligned, which covers every alignment up to a page, and larger ones are met by
rounding each slot's stride up. Engines that hand raw addresses to the kernel (io_uring) need
those addresses, so the pool exposes both memoryviews and addresses.
"""

from __future__ import annotations

import ctypes
import mmap

from .linux import PAGE_SIZE


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


class BufferPool:
    """``count`` buffers of ``size`` bytes, each starting at an address aligned to ``align``."""

    def __init__(self, count: int, size: int, align: int = 1) -> None:
        align = max(align, 1)
        stride = round_up(max(size, 1), max(PAGE_SIZE, align))
        self.size = size
        self._mm = mmap.mmap(-1, stride * count + (align if align > PAGE_SIZE else 0))
        self._anchor = ctypes.c_char.from_buffer(self._mm)
        base = ctypes.addressof(self._anchor)
        skip = (-base) % align if align > PAGE_SIZE else 0
        whole = memoryview(self._mm)
        self.views: list[memoryview] = [
            whole[skip + i * stride : skip + i * stride + size] for i in range(count)
        ]
        self.addresses: list[int] = [base + skip + i * stride for i in range(count)]
        self._whole = whole

    def close(self) -> None:
        """Release the memory; no view may be used afterwards."""
        for v in self.views:
            v.release()
        self.views = []
        self._whole.release()
        del self._anchor
        self._mm.close()
