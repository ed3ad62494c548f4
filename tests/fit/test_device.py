"""The storage profile: measured on the device (a real probe and real faults, kept tiny
here), cached per device in the user's cache directory, measured again on request."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from moepack.errors import BadInput
from moepack.fit.device import device_key, measure_storage, profile_path, storage_profile

TINY = dict(sizes=[64 << 10, 256 << 10], depths=[1, 8], cell_seconds=0.02, repeats=1,
            fault_slices=4)  # fmt: skip


@pytest.fixture
def data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MOEPACK_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(8 << 20))
    return path


def test_measured_faults_and_surface(data: Path) -> None:
    p = measure_storage(data, **TINY)  # type: ignore[arg-type]
    assert [c.slice_bytes for c in p.faults] == [64 << 10, 256 << 10]
    for c in p.faults:
        assert c.seconds > 0
        assert c.bytes_read >= c.slice_bytes * 0.9  # the kernel brings in at least the slice
    assert p.bandwidth(100 << 10, 8) > 0
    assert p.fault(128 << 10).seconds > 0
    assert data.read_bytes()[:4]  # only read


def test_cached_per_device_and_remeasured(data: Path) -> None:
    first = storage_profile(data, **TINY)  # type: ignore[arg-type]
    assert not first.cached
    key, _ = device_key(data)
    path = profile_path(key)
    assert path.exists() and path.is_relative_to(Path(os.environ["MOEPACK_CACHE_DIR"]))
    again = storage_profile(data)
    assert again.cached and again.measured == first.measured
    assert again.faults == first.faults
    fresh = storage_profile(data, probe=True, **TINY)  # type: ignore[arg-type]
    assert not fresh.cached
    path.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(BadInput, match="not a storage measurement"):
        storage_profile(data)
    path.write_text("{")
    with pytest.raises(BadInput, match="`probe` measures it again"):
        storage_profile(data)


def test_the_pager_s_reads_are_priced_at_the_direct_surface(data: Path) -> None:
    """O_DIRECT reads at the pager's request size (at most 1 MiB) and depth; a profile of
    the first version (no direct surface) is measured again, not refused."""
    p = measure_storage(data, **TINY)  # type: ignore[arg-type]
    if p.direct is None:  # a filesystem that refuses O_DIRECT: the pager reads buffered
        assert p.pager_bandwidth(200 << 10, 8) == p.bandwidth(200 << 10, 8)
        return
    assert p.direct.mode == "direct"
    assert p.pager_bandwidth(200 << 10, 8) == p.direct.bandwidth(200 << 10, 8)
    assert p.pager_bandwidth(16 << 20, 8) == p.direct.bandwidth(1 << 20, 8)  # 1 MiB reads
    key, _ = device_key(data)
    doc = p.to_json()
    doc["format"] = "moepack-fit-storage/1"
    del doc["direct"]
    profile_path(key).parent.mkdir(parents=True, exist_ok=True)
    profile_path(key).write_text(json.dumps(doc))
    again = storage_profile(data, **TINY)  # type: ignore[arg-type]
    assert not again.cached and again.direct is not None
