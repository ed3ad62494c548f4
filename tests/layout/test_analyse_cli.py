"""``moepack analyse`` end to end on a synthetic model and its planted-cluster trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moefixtures import run_cli, synth_with_trace
from moepack.storage.surface import Surface, SurfaceCell
from moepack.trace import load_trace, save_trace


@pytest.fixture
def pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, Path]:
    return synth_with_trace(capsys, tmp_path, "--layers", "2", "--tokens", "600")


def surface_file(folder: Path) -> Path:
    cells = [SurfaceCell(s, 1, s / (1e-4 + s / 1e9)) for s in (4096, 65536, 1 << 20)]
    return Surface(cells, engine="pread").save(folder / "dev.surface.json")


def test_analyse_json_ranks_expert_major_above_identity(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, trace = pair
    surface = surface_file(tmp_path)
    code, out, err = run_cli(capsys, "analyse", model, trace, "--surface", surface, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["layouts"] == ["identity", "pipeline", "fused", "expert-major"]
    s = doc["summary"]
    assert s["identity"]["speedup"] == 1.0
    assert s["expert-major"]["requests_per_token"] < s["identity"]["requests_per_token"]
    assert s["expert-major"]["speedup"] > 1.0
    assert doc["fit"]["t_op_us"] == pytest.approx(100, rel=0.05)
    assert [r["block"] for r in doc["layers"]] == [0, 1]


def test_analyse_measure_and_plot(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, trace = pair
    png = tmp_path / "speedup.png"
    code, out, err = run_cli(
        capsys,
        "analyse",
        model,
        trace,
        "--layouts",
        "identity,expert-major",
        "--measure",
        "--mode",
        "buffered",
        "--measure-tokens",
        "50",
        "--tokens",
        "300:",
        "--plot",
        png,
    )
    assert code == 0, err
    assert "measured us" in out and "fewer requests" in out  # no surface: no time claimed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out, err = run_cli(
        capsys,
        "analyse",
        model,
        trace,
        "--layouts",
        "identity,expert-major",
        "--measure",
        "--mode",
        "buffered",
        "--measure-tokens",
        "50",
        "--json",
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc["tokens"] == [0, 50]
    assert [r["layout"] for r in doc["replays"]] == ["identity", "expert-major"]
    assert all(r["measured_us_per_token"] > 0 for r in doc["replays"])
    assert "no surface" in " ".join(doc["notes"])


def test_analyse_bad_input_is_one_line_exit_2(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, trace = pair
    code, _, err = run_cli(capsys, "analyse", model, trace, "--layouts", "pipeline+expert-major")
    assert code == 2 and "cannot combine" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(capsys, "analyse", model, trace, "--layouts", "reorder")
    assert code == 2 and "needs a plan" in err
    full = load_trace(trace)
    part = full.replace(ids=full.ids[:, 1:, :].copy(), block_map=[1], weights=None)
    save_trace(part, tmp_path / "part.moetrace")
    code, _, err = run_cli(capsys, "analyse", model, tmp_path / "part.moetrace")
    assert code == 2 and "not covered: 0" in err
    code, _, err = run_cli(capsys, "analyse", model, trace, "--tokens", "700:")
    assert code == 2 and "token range" in err
    (tmp_path / "o").mkdir()
    other, _ = synth_with_trace(capsys, tmp_path / "o", "--layers", "2", "--seed", "9")
    code, _, err = run_cli(capsys, "analyse", other, trace)
    assert code == 2 and "fingerprint" in err
