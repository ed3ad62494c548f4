"""``moepack fit`` end to end: a local model and the same split set over HTTP give the same
estimate, a trace narrows the hit rates to one value, --verify runs the model, and bad
inputs are one line with exit 2. The calibration runs in llama.cpp once per module (into a
temporary cache directory); the storage is measured tiny once and cached there too."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.synth import synth_model
from moepack.fit.device import storage_profile
from moepack.trace import synth_trace
from moepack.trace.formats import save_trace
from rangeserver import serving

pytestmark = pytest.mark.slow

TINY = dict(sizes=[64 << 10, 256 << 10], depths=[1, 8], cell_seconds=0.02, repeats=1,
            fault_slices=4)  # fmt: skip


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder with a model, its 3-shard split twin and a trace; the cache directory set
    for the module, the storage measured into it (tiny) for the model's device."""
    d = tmp_path_factory.mktemp("fit")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOEPACK_CACHE_DIR", str(d / "cache"))
        spec = tiny_spec(layers=3)
        synth_model(d / "m.gguf", spec)
        synth_model(d / "split.gguf", spec, split_max_size=340_000)
        with MoeModel(d / "m.gguf") as m:
            save_trace(synth_trace(m, tokens=200, prefill_tokens=50, seed=5), d / "t.moetrace")
        storage_profile(d / "m.gguf", **TINY)  # type: ignore[arg-type]
        (d / "cache" / "fit" / "probe").mkdir(parents=True)
        yield d


def _fit(capsys: pytest.CaptureFixture[str], *args: object) -> dict[str, Any]:
    code, out, err = run_cli(capsys, "fit", *args, "-t", "1", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert isinstance(doc, dict)
    return doc


def test_local_json(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _fit(capsys, home / "m.gguf", "--memory", "2G")
    assert doc["fits"] is True and doc["verdict"] == "fits"
    points = doc["points"]
    assert isinstance(points, list) and len(points) >= 1
    main = points[0]
    assert main["memory"] == 2 << 30
    for runner in ("stock", "prefetch"):
        e = main[runner]
        assert e["decode_tps"]["low"] > 0 and e["prefill_tps"]["low"] > 0
        assert e["limiter"] == "CPU" and e["threads"] == 1
    assert doc["hit_source"] == "priors" and "PR #27861" in str(doc["hit_prior_source"])
    cal = doc["calibration"]
    assert isinstance(cal, dict) and cal["times"][0]["threads"] == 1
    assert {"knee", "fit_memory", "min_memory", "shape", "storage", "machine"} <= set(doc)
    small = _fit(capsys, home / "m.gguf", "--memory", "1M")
    assert small["fits"] is False and small["verdict"] in ("streams", "too slow")
    assert small["calibration"]["cached"] is True  # measured once per shape set


def test_url_matches_local(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shards = sorted(home.glob("split-*-of-00003.gguf"))
    assert len(shards) == 3
    local = _fit(capsys, shards[0], "--memory", "1M")
    with serving(home) as srv:
        remote = _fit(capsys, f"{srv.url}/{shards[2].name}", "--memory", "1M")
    assert remote["remote"]["bytes_read"] < remote["remote"]["total_bytes"]
    assert len(remote["remote"]["shards"]) == 3
    assert remote["shape"] == local["shape"]
    assert remote["calibration"]["key"] == local["calibration"]["key"]


def test_trace_narrows_hits(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _fit(capsys, home / "m.gguf", "--memory", "1M", "--trace", home / "t.moetrace")
    assert doc["hit_source"] == "trace"
    for p in doc["points"]:
        hit = p["prefetch"]["hit_rate"]
        if hit is not None:
            assert hit["low"] == hit["high"]


def test_table(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "fit", home / "m.gguf", "-t", "1", "--memory", "1M", "-q")
    assert code == 0, err
    for word in ("does not fit", "verdict", "moepack run --prefetch", "knee", "storage:"):
        assert word in out


def test_verify(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _fit(capsys, home / "m.gguf", "--verify")
    v = doc["verify"]
    assert isinstance(v, dict)
    names = [f["figure"] for f in v["figures"]]
    assert names == ["stock decode", "stock prefill", "prefetch decode", "prefetch prefill"]
    assert all(f["measured"] > 0 for f in v["figures"])
    assert len(v["runs"]) == 2


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["missing.gguf"], "missing.gguf"),
        (["t.moetrace"], "not a GGUF"),
        (["m.gguf", "--trace", "m.gguf"], "m.gguf"),
        (["http://127.0.0.1:9/m.gguf", "--verify"], "give a local file"),
        (["m.gguf", "--memory", "lots"], "not a size"),
    ],
)
def test_bad_inputs(
    home: Path, capsys: pytest.CaptureFixture[str], args: list[str], problem: str
) -> None:
    here = Path.cwd()
    os.chdir(home)
    try:
        code, out, err = run_cli(capsys, "fit", *args, "-q")
    finally:
        os.chdir(here)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and problem in lines[0], err


def test_trace_of_another_shape(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "o.moetrace"
    save_trace(synth_trace(layers=5, n_expert=8, top_k=2, tokens=20), other)
    code, out, err = run_cli(capsys, "fit", home / "m.gguf", "--trace", other, "-q")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert str(other) in err
