"""probe and kio end to end in the library, on tiny corpora and tiny time budgets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moepack.errors import BadInput
from moepack.storage import Mode
from moepack.storage.kio import run_kio
from moepack.storage.probe import run_probe

MiB = 1 << 20


def test_probe_on_a_folder_makes_a_surface(tmp_path: Path) -> None:
    r = run_probe(
        tmp_path, sizes=[4096, 65536], depths=[1, 4], cell_seconds=0.02, corpus_bytes=4 * MiB
    )
    s = r.surface
    assert r.corpus_created and r.target == tmp_path / "moepack-corpus.bin"
    assert {(c.request_bytes, c.queue_depth) for c in s.cells} == {
        (4096, 1), (4096, 4), (65536, 1), (65536, 4),
    }  # fmt: skip
    assert all(c.bytes_per_sec > 0 and c.lat_p50_us and c.iops for c in s.cells)
    assert s.mode == "direct" and s.cache_bypassed is True and s.engine in ("uring", "threads")
    assert s.device and s.device["kernel"] == os.uname().release
    assert s.device["dio_offset_align"] > 0 and s.device["filesystem"]
    assert s.created and s.bandwidth(16384, 2) > 0
    again = run_probe(tmp_path, sizes=[4096], depths=[1], cell_seconds=0.01, corpus_bytes=4 * MiB)
    assert not again.corpus_created


def test_probe_reads_an_existing_file_only(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    before = path.stat().st_mtime_ns
    r = run_probe(
        path, engine="threads", mode=Mode.BUFFERED, sizes=[65536], depths=[2],
        cell_seconds=0.02,
    )  # fmt: skip
    assert r.target == path and not r.corpus_created and r.surface.mode == "buffered"
    assert path.stat().st_mtime_ns == before and path.read_bytes() == data
    assert list(path.parent.iterdir()) == [path]


def test_probe_refuses_bad_requests(data_file: tuple[Path, bytes], tmp_path: Path) -> None:
    path, _ = data_file
    with pytest.raises(BadInput, match="queue depth 1 only"):
        run_probe(path, engine="pread", sizes=[4096], depths=[1, 8], cell_seconds=0.01)
    with pytest.raises(BadInput, match="less than the largest request"):
        run_probe(path, sizes=[32 * MiB], depths=[1], cell_seconds=0.01)
    with pytest.raises(BadInput, match="missing: does not exist"):
        run_probe(tmp_path / "missing", sizes=[4096], depths=[1], cell_seconds=0.01)


def test_probe_direct_on_ramfs_is_a_clear_error(mounted) -> None:
    d = mounted("ramfs")
    with pytest.raises(BadInput, match="ramfs does not support O_DIRECT"):
        run_probe(d, sizes=[4096], depths=[1], cell_seconds=0.01, corpus_bytes=MiB)


def test_kio_full_report(tmp_path: Path) -> None:
    r = run_kio(
        tmp_path, sizes=[65536], depths=[1, 4], cell_seconds=0.02, corpus_bytes=8 * MiB, repeats=2
    )
    got = {(row.engine, row.mode, row.queue_depth) for row in r.rows}
    for mode in ("buffered", "direct", "dontcache"):
        assert ("pread", mode, 1) in got
        for eng in ("threads", "uring", "uring-batch"):
            assert (eng, mode, 4) in got
    assert ("mmap", "buffered", 1) in got and ("mmap", "direct", 1) not in got
    for row in r.rows:
        assert row.ratio_qd1 is not None and row.ratio_qd1 > 0
        if row.engine == "pread":
            assert row.ratio_qd1 == 1.0
    assert {w.mode for w in r.windows} == {"buffered", "direct", "dontcache"}
    for w in r.windows:
        assert w.gain == pytest.approx(w.sliding_gbps / w.batch_gbps - 1)
        rows = {(x.engine, x.mode, x.queue_depth): x.cell for x in r.rows}
        a, b = rows[("uring", w.mode, w.queue_depth)], rows[("uring-batch", w.mode, w.queue_depth)]
        assert w.within_noise == (a.low <= b.high and b.low <= a.high)
    assert {d.engine for d in r.dontcache} == {"pread", "threads", "uring", "uring-batch"}
    for d in r.dontcache:
        if d.buffered_residency is not None:
            assert d.buffered_residency > 0.5 > (d.dontcache_residency or 0)
    (rec,) = r.recommendations
    best = max(r.rows, key=lambda x: x.gbps)
    assert (rec.engine, rec.mode, rec.queue_depth) == (best.engine, best.mode, best.queue_depth)
    other = max((x for x in r.rows if (x.engine, x.mode) != (best.engine, best.mode)),
                key=lambda x: x.gbps)  # fmt: skip
    assert rec.runner_up == f"{other.engine} {Mode(other.mode).label} QD{other.queue_depth}"
    assert rec.margin == pytest.approx(best.gbps / other.gbps - 1)
    assert rec.tie == (best.cell.low <= other.cell.high and other.cell.low <= best.cell.high)
    assert all(row.cell.repeats == 2 for row in r.rows)
    assert r.skipped == [] and r.corpus_created


def test_kio_goes_on_without_direct_and_dontcache(mounted) -> None:
    d = mounted("ramfs")
    r = run_kio(
        d, sizes=[65536], depths=[1, 2], engines=["pread", "uring"], cell_seconds=0.01,
        corpus_bytes=2 * MiB,
    )  # fmt: skip
    reasons = {s.name: s.reason for s in r.skipped if s.what == "mode"}
    assert "ramfs does not support O_DIRECT" in reasons["direct"]
    assert "ramfs does not support RWF_DONTCACHE" in reasons["dontcache"]
    assert {row.mode for row in r.rows} == {"buffered"}
    assert {row.engine for row in r.rows} == {"pread", "uring"}


def test_kio_bad_choices(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="unknown engine 'aio'"):
        run_kio(tmp_path, engines=["aio"], corpus_bytes=MiB)
    with pytest.raises(BadInput, match="exceeds the corpus"):
        run_kio(tmp_path, sizes=[4 * MiB], depths=[1], cell_seconds=0.01, corpus_bytes=MiB)
    assert list(tmp_path.iterdir()) == [tmp_path / "moepack-corpus.bin"]


def test_thrash_and_cache_notes_follow_the_numbers(tmp_path: Path) -> None:
    from dataclasses import replace

    from moepack.storage.kio import _cache_note, _thrash

    r = run_kio(
        tmp_path, sizes=[65536], depths=[1], engines=["pread"], modes=[Mode.BUFFERED],
        cell_seconds=0.02, corpus_bytes=2 * MiB,
    )  # fmt: skip
    (row,) = r.rows
    cell = row.cell
    assert _thrash([cell]) == [] == r.thrash
    pages_read = cell.bytes // 4096
    assert _thrash([replace(cell, evicted_pages=pages_read // 1000)]) == []  # noise, not thrash
    (msg,) = _thrash([replace(cell, evicted_pages=pages_read // 2)])
    assert f"evicted {pages_read // 2:,} corpus pages" in msg
    assert "in the page cache" in (_cache_note(row) or "")
    assert r.recommendations[0].cache_note == _cache_note(row)


def test_probe_refuses_a_grid_larger_than_memory(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="more than half the available memory"):
        run_probe(tmp_path, sizes=[1 << 40], depths=[64], cell_seconds=0.01, corpus_bytes=MiB)
    assert list(tmp_path.iterdir()) == []


def test_an_engine_that_cannot_run_is_reported_and_the_rest_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys
    import textwrap

    from moepack.registry import Registry
    from moepack.storage import engine as engine_mod
    from moepack.storage import engines as engines_pkg

    extra = tmp_path / "extra_engines"
    extra.mkdir()
    (extra / "zz_unavailable.py").write_text(
        textwrap.dedent(
            """
            from moepack.storage.engine import ReadEngine

            class Unavailable(ReadEngine):
                name = "unavailable"
                summary = "an engine whose kernel interface is switched off"

                def unavailable_reason(self):
                    return "io_uring is disabled here (test)"

                def run(self, f, work, queue_depth):  # pragma: no cover - never called
                    raise AssertionError("an unavailable engine must not run")

            PLUGIN = Unavailable()
            """
        )
    )
    monkeypatch.setattr(engines_pkg, "__path__", [*engines_pkg.__path__, str(extra)])
    monkeypatch.delitem(sys.modules, "moepack.storage.engines.zz_unavailable", raising=False)
    fresh: Registry[engine_mod.ReadEngine] = Registry(
        "engine", "moepack.storage.engines", base=engine_mod.ReadEngine
    )
    monkeypatch.setattr(engine_mod, "READ_ENGINES", fresh)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    r = run_kio(
        corpus, sizes=[65536], depths=[1, 2], engines=["pread", "unavailable"],
        modes=[Mode.DIRECT], cell_seconds=0.01, corpus_bytes=2 * MiB,
    )  # fmt: skip
    assert [(s.what, s.name, s.reason) for s in r.skipped] == [
        ("engine", "unavailable", "io_uring is disabled here (test)")
    ]
    assert {row.engine for row in r.rows} == {"pread"}
    with pytest.raises(BadInput, match="cannot run here: io_uring is disabled"):
        run_probe(corpus, engine="unavailable", sizes=[4096], depths=[1], corpus_bytes=2 * MiB)


def _row(engine: str, median: float, low: float, high: float):
    from moepack.storage.kio import KioRow
    from moepack.storage.measure import CellResult, combine

    def run(bps: float) -> CellResult:
        return CellResult(engine, "direct", 65536, 4, 1.0, 10, int(bps), bps, bps / 65536,
                          100.0, 300.0, 120.0, 0.1, 1.0, 0, 0, 0, 0, False)  # fmt: skip

    return KioRow(engine, "direct", 65536, 4, combine([run(low), run(median), run(high)]), None)


def test_recommendation_is_a_tie_exactly_when_the_runs_overlap() -> None:
    """A fixed margin judged noise by a constant; now the runs decide: +30 % with overlapping
    runs is a tie, +3 % with the runner-up's fastest run below the winner's slowest is not."""
    from moepack.storage.kio import _recommend

    (rec,) = _recommend([_row("uring", 1.3e9, 0.8e9, 1.6e9), _row("threads", 1.0e9, 0.9e9, 1.1e9)],
                        [65536])  # fmt: skip
    assert rec.engine == "uring" and rec.margin == pytest.approx(0.3) and rec.tie
    assert rec.best_range_gbps == (0.8, 1.6) and rec.runner_up_range_gbps == (0.9, 1.1)
    (rec,) = _recommend([_row("uring", 1.03e9, 1.02e9, 1.04e9),
                         _row("threads", 1.0e9, 0.99e9, 1.01e9)], [65536])  # fmt: skip
    assert rec.margin == pytest.approx(0.03) and not rec.tie


def test_probe_keeps_median_and_spread_of_interleaved_runs(tmp_path: Path) -> None:
    r = run_probe(tmp_path, sizes=[65536], depths=[1, 2], cell_seconds=0.02,
                  corpus_bytes=4 * MiB, repeats=3)  # fmt: skip
    for c in r.surface.cells:
        assert c.repeats == 3
        assert c.bytes_per_sec_low is not None and c.bytes_per_sec_high is not None
        assert c.bytes_per_sec_low <= c.bytes_per_sec <= c.bytes_per_sec_high
    assert all(len(c.runs_bytes_per_sec) == 3 for c in r.cells)
    assert "median of 3 interleaved runs" in r.surface.note


def test_direct_on_tmpfs_is_not_called_cache_bypassed(mounted) -> None:
    """tmpfs has no block device: O_DIRECT there reads RAM. The probe says so and the surface
    does not claim cache_bypassed (it claimed 4.5 GB/s 'cold' from /dev/shm)."""
    d = mounted("tmpfs", "size=16m")
    r = run_probe(d, sizes=[65536], depths=[1], cell_seconds=0.01, corpus_bytes=4 * MiB,
                  repeats=1)  # fmt: skip
    assert r.surface.cache_bypassed is False
    assert any("no block device" in w and "RAM" in w for w in r.warnings), r.warnings


def test_direct_on_a_disk_is_cache_bypassed(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    r = run_probe(path, sizes=[65536], depths=[1], cell_seconds=0.01, repeats=1)
    if r.surface.device and r.surface.device.get("block_device") is None:
        pytest.skip("the test folder is not on a block device here")
    assert r.surface.cache_bypassed is True and not r.warnings


def test_probing_a_users_file_gives_its_cached_pages_back(data_file: tuple[Path, bytes]) -> None:
    """Cold cells drop the file's pages; for the user's own file (a model) the pages that were
    cached are read back afterwards, in every mode."""
    import time

    from moepack.storage.linux import cachestat

    path, data = data_file
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            cachestat(fd)
        except OSError:
            pytest.skip("no cachestat here")
        for mode in (Mode.DIRECT, Mode.BUFFERED):
            os.pread(fd, len(data), 0)  # the user had it all cached
            r = run_probe(path, mode=mode, engine="pread", sizes=[65536], depths=[1],
                          cell_seconds=0.01, repeats=1)  # fmt: skip
            assert r.cache_restored_bytes >= len(data) - (1 << 20)
            deadline = time.monotonic() + 30  # WILLNEED reads in the background
            while cachestat(fd).nr_cache * 4096 < 0.9 * len(data) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert cachestat(fd).nr_cache * 4096 >= 0.9 * len(data)
    finally:
        os.close(fd)
    # a corpus moepack made is not read back: nothing of the user's was dropped
