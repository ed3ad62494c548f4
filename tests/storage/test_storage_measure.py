"""Measurement cells: cold start, accounting, residency per mode, no block read twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from moepack.errors import BadInput
from moepack.storage import Mode, get_engine, open_file
from moepack.storage.measure import _RandomWork, measure_cell


def test_random_work_never_repeats_a_block_in_cached_modes() -> None:
    w = _RandomWork(64 * 4096 + 100, 4096, deadline_ns=1 << 62, wrap=False, seed=3)
    offsets = []
    while (req := w.next()) is not None:
        offsets.append(req[1])
    assert sorted(offsets) == [i * 4096 for i in range(64)]
    assert w.exhausted


def test_random_work_wraps_in_direct_mode() -> None:
    w = _RandomWork(8 * 4096, 4096, deadline_ns=1 << 62, wrap=True, seed=3)
    offsets = [w.next()[1] for _ in range(20)]  # type: ignore[index]
    assert w.exhausted and len(set(offsets)) == 8


@pytest.mark.parametrize(
    ("engine", "qd"), [("pread", 1), ("threads", 4), ("uring", 4), ("uring-batch", 4)]
)
def test_cell_accounting(data_file: tuple[Path, bytes], engine: str, qd: int) -> None:
    path, _ = data_file
    with open_file(path, Mode.DIRECT) as f:
        c = measure_cell(f, get_engine(engine), 65536, qd, seconds=0.05)
    assert c.requests > 0 and c.bytes == c.requests * 65536
    assert c.bytes_per_sec == pytest.approx(c.bytes / c.seconds)
    assert c.iops == pytest.approx(c.requests / c.seconds)
    assert 0 < c.lat_p50_us <= c.lat_p99_us
    assert c.cpu_seconds >= 0
    assert c.engine == engine and c.mode == "direct" and c.queue_depth == qd


def test_buffered_cell_starts_cold_and_fills_cache(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    path.read_bytes()  # warm the cache: the cell must drop it first
    with open_file(path, Mode.BUFFERED) as f:
        c = measure_cell(f, get_engine("threads"), 65536, 4, seconds=5.0)
    if c.cache_pages_before is None:
        pytest.skip("no cachestat here")
    assert c.cache_pages_before * 4096 < len(data) // 10
    assert c.exhausted  # a small file is read once in full, never twice
    assert c.bytes == len(data) // 65536 * 65536
    assert c.residency is not None and c.residency > 0.9


def test_dontcache_cell_leaves_little_cached(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    with open_file(path, Mode.DONTCACHE) as f:
        c = measure_cell(f, get_engine("uring"), 65536, 4, seconds=5.0)
    if c.residency is None:
        pytest.skip("no cachestat here")
    assert c.residency < 0.2


def test_direct_cell_leaves_nothing_cached(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    with open_file(path, Mode.DIRECT) as f:
        c = measure_cell(f, get_engine("pread"), 65536, 1, seconds=0.05)
    assert c.residency in (None, 0.0)


def test_cell_rejects_bad_geometry(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    with open_file(path, Mode.DIRECT) as f:
        with pytest.raises(BadInput, match="not a multiple of the O_DIRECT alignment"):
            measure_cell(f, get_engine("pread"), 1000, 1, seconds=0.01)
        with pytest.raises(BadInput, match="less than one request"):
            measure_cell(f, get_engine("pread"), 64 << 20, 1, seconds=0.01)


def test_deep_queue_of_large_requests_still_refills_once() -> None:
    """A cell whose deadline has passed still issues twice its queue depth of requests."""
    w = _RandomWork(1 << 30, 1 << 20, deadline_ns=0, wrap=True, seed=1, min_requests=8)
    got = 0
    while w.next() is not None:
        got += 1
    assert got == 8
