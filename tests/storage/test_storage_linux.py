"""The ctypes calls against the real kernel: cachestat, fadvise, statx DIOALIGN."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moepack.pages import drop_cached
from moepack.storage.device import describe_device
from moepack.storage.linux import PAGE_SIZE, cachestat, statx_dio_align


def test_cachestat_sees_reads_and_drops(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        drop_cached(fd)
        try:
            cold = cachestat(fd)
        except OSError as e:
            pytest.skip(f"no cachestat here: {e}")
        assert cold.nr_cache * PAGE_SIZE < len(data) // 10
        os.pread(fd, len(data), 0)
        warm = cachestat(fd)
        assert warm.nr_cache >= len(data) // PAGE_SIZE
        part = cachestat(fd, 0, 2 * PAGE_SIZE)
        assert part.nr_cache == 2
        drop_cached(fd)
        assert cachestat(fd).nr_cache * PAGE_SIZE < len(data) // 10
    finally:
        os.close(fd)


def test_statx_dio_alignment_on_disk(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    align = statx_dio_align(path)
    if align is None:
        pytest.skip("statx DIOALIGN not reported here")
    assert align.offset > 0 and align.mem > 0
    assert align.offset & (align.offset - 1) == 0


def test_device_identity(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    dev = describe_device(path)
    assert dev.filesystem not in ("", "unknown")
    assert dev.kernel == os.uname().release
    assert Path(dev.path) == path.resolve()
