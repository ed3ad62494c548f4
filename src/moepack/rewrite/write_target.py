"""Writing a described file (``target``): header, padding, every tensor's ranges, streamed.

The byte moving is ``copy.copy_ranges`` (in the kernel where it can, with read-ahead and early
writeback), so a layout rewrite streams with the same bounded memory as a permutation.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import MoepackError
from ..progress import ProgressSink
from ..storage.copy import RangeCopier, copy_ranges, pwrite_all, write_zeros
from ..storage.writeback import Writeback
from .target import OutTensor, aligned


def write_shard(
    source: Path,
    shard_index: int,
    dst_fd: int,
    header: bytes,
    tensors: list[OutTensor],
    alignment: int,
    data_bytes: int,
    progress: ProgressSink,
) -> int:
    """Write one output shard whose tensors all come from ``source`` (shard ``shard_index`` of
    the source model: tensors never move between shards); returns the file length."""
    data_start = aligned(len(header), alignment)
    pwrite_all(dst_fd, header, 0)
    write_zeros(dst_fd, len(header), data_start - len(header))
    ranges: list[tuple[int, int, int]] = []
    pos = 0
    for t in tensors:
        write_zeros(dst_fd, data_start + pos, t.rel_offset - pos)
        for shard, src, dst, n in t.ranges(data_start):
            if shard != shard_index:
                raise MoepackError(f"internal: tensor {t.name!r} would move between shards")
            ranges.append((src, dst, n))
        pos = t.rel_offset + t.n_bytes
    src_fd = os.open(source, os.O_RDONLY)
    try:
        with Writeback(dst_fd) as writeback:
            copy_ranges(RangeCopier(src_fd, dst_fd), ranges, progress.advance, writeback)
    finally:
        os.close(src_fd)
    write_zeros(dst_fd, data_start + pos, data_bytes - pos)
    return data_start + data_bytes
