"""Measurement cells: cold start, accounting, residency per mode, no block read twice."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moepack.errors import BadInput
from moepack.storage import Mode, get_engine, open_file
from moepack.storage.measure import (
    CellResult,
    RandomWork,
    SlotPermutation,
    combine,
    measure_cell,
    spreads_overlap,
)


def test_random_work_never_repeats_a_block_in_cached_modes() -> None:
    w = RandomWork(64 * 4096 + 100, 4096, wrap=False, seed=3)
    offsets = []
    while (req := w.next()) is not None:
        offsets.append(req[1])
    assert sorted(offsets) == [i * 4096 for i in range(64)]
    assert offsets != sorted(offsets)  # random order
    assert w.exhausted


def test_random_work_wraps_in_direct_mode() -> None:
    w = RandomWork(8 * 4096, 4096, wrap=True, seed=3)
    offsets = [w.next()[1] for _ in range(20)]  # type: ignore[index]
    assert w.exhausted and len(set(offsets)) == 8
    assert sorted(offsets[:8]) == sorted(offsets[8:16])  # every pass is a whole permutation


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097, 70_001])
def test_slot_permutation_is_a_permutation(n: int) -> None:
    p = SlotPermutation(n, seed=n, batch=512)
    got: list[int] = []
    while chunk := p.take():
        got += chunk
    assert sorted(got) == list(range(n))
    if n > 100:
        assert got != sorted(got)
        assert SlotPermutation(n, seed=n + 1).take() != SlotPermutation(n, seed=n).take()


_RSS_PROBE = """
import os, sys
from moepack.storage import Mode, get_engine, open_file
from moepack.storage.measure import measure_cell

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])

path, mode = sys.argv[1], Mode(sys.argv[2])
with open_file(path, mode) as f:
    measure_cell(f, get_engine("pread"), 4096, 1, 0.01)  # imports and first-use costs
    base = kib("VmRSS")
    c = measure_cell(f, get_engine("pread"), 4096, 1, 0.2, seed=5)
print(base, kib("VmHWM"), c.requests)
"""


@pytest.mark.parametrize("mode", ["direct", "buffered"])
def test_cell_memory_does_not_grow_with_the_file(tmp_path: Path, mode: str) -> None:
    """A 64 GiB sparse file holds 16 M slots of 4 KiB: drawing the offsets must not cost
    memory in proportion (a permutation of them took ~600 MB and most of the cell's time)."""
    big = tmp_path / "sparse.bin"
    with open(big, "wb") as fh:
        try:
            fh.truncate(64 << 30)
        except OSError as e:
            pytest.skip(f"no sparse 64 GiB file here: {e}")
    script = tmp_path / "rss.py"
    script.write_text(_RSS_PROBE)
    r = subprocess.run(
        [sys.executable, str(script), str(big), mode], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    base, peak, requests = map(int, r.stdout.split())
    assert requests > 0
    assert peak - base < 48 * 1024, f"peak RSS grew by {(peak - base) // 1024} MiB"


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
    assert c.cpu_sec_per_gb == pytest.approx(c.cpu_seconds / (c.bytes / 1e9))
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
    w = RandomWork(1 << 30, 1 << 20, wrap=True, seed=1, min_requests=8)
    w.start(0.0)
    got = 0
    while w.next() is not None:
        got += 1
    assert got == 8


def _fake(bps: float, **kw: object) -> CellResult:
    base = dict(
        engine="e", mode="direct", request_bytes=65536, queue_depth=4, seconds=1.0, requests=10,
        bytes=bps, bytes_per_sec=bps, iops=bps / 65536, lat_p50_us=100.0, lat_p99_us=300.0,
        lat_mean_us=120.0, cpu_seconds=0.1, cpu_sec_per_gb=1.0, cache_pages_before=0,
        cache_pages_after=0, evicted_pages=0, recently_evicted_pages=0, exhausted=False,
    )  # fmt: skip
    base.update(kw)
    return CellResult(**base)  # type: ignore[arg-type]


def test_combined_runs_report_median_and_spread() -> None:
    runs = [_fake(3e8, lat_p50_us=90.0), _fake(1e8, exhausted=True), _fake(2e8, evicted_pages=5)]
    c = combine(runs)
    assert c.bytes_per_sec == 2e8 and (c.low, c.high) == (1e8, 3e8) and c.repeats == 3
    assert c.runs_bytes_per_sec == [3e8, 1e8, 2e8]
    assert c.requests == 30 and c.seconds == 3.0 and c.lat_p50_us == 100.0
    assert c.exhausted and c.evicted_pages == 5
    assert spreads_overlap(c, _fake(2.9e8)) and not spreads_overlap(c, _fake(3.1e8))
    assert combine([runs[0]]) is runs[0]


def test_cells_are_measured_round_by_round_in_alternating_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from moepack.storage import measure

    order: list[int] = []

    def fake_cell(f, engine, size, qd, seconds, seed=0):
        order.append(size)
        return _fake(float(size * [2, 1, 3][(len(order) - 1) // 3]), request_bytes=size)

    monkeypatch.setattr(measure, "measure_cell", fake_cell)
    plan = [(None, None, s, 1) for s in (1, 2, 3)]
    cells = measure.measure_interleaved(plan, 0.1, 3)  # type: ignore[arg-type]
    assert order == [1, 2, 3, 3, 2, 1, 1, 2, 3]
    assert [c.request_bytes for c in cells] == [1, 2, 3]
    assert all(c.repeats == 3 and c.low < c.bytes_per_sec < c.high for c in cells)
    with pytest.raises(BadInput, match="repeats"):
        measure.measure_interleaved(plan, 0.1, 0)  # type: ignore[arg-type]
