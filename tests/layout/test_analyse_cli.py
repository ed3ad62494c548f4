"""``moepack analyse`` end to end on a synthetic model and its planted-cluster trace."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
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
    # a qwen3moe: fused is costed, and the notes say stock llama.cpp would not load it
    assert any("fused: costed only" in n for n in doc["notes"])
    assert [r["block"] for r in doc["layers"]] == [0, 1]


def test_analyse_measure_and_plot(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, trace = pair
    png = tmp_path / "speedup.png"
    measure = ["analyse", model, trace, "--layouts", "identity,expert-major", "--measure"]
    measure += ["--mode", "buffered", "--measure-tokens", "50"]
    code, out, err = run_cli(capsys, *measure, "--tokens", "300:", "--plot", png)
    assert code == 0, err
    assert "measured us" in out and "fewer requests" in out  # no surface: no time claimed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out, err = run_cli(capsys, *measure, "--json")
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


def test_analyse_measure_per_layer_and_both_plots(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, trace = pair
    plan = tmp_path / "p.moeplan"
    code, _, err = run_cli(capsys, "plan", model, "--trace", trace, "--out", plan)
    assert code == 0, err
    speed, coact = tmp_path / "speed.png", tmp_path / "coact.png"
    args = ["analyse", model, trace, "--plan", plan, "--layouts", "identity,reorder,expert-major"]
    run = [*args, "--measure", "--mode", "buffered", "--measure-tokens", "40"]
    code, out, err = run_cli(
        capsys, *run, "--chunk-tokens", "10", "--plot", speed, "--coact-plot", coact, "--json"
    )
    assert code == 0, err
    doc = json.loads(out)
    for png in (speed, coact):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for layer in doc["layers"]:
        measured = layer["measured_us_per_token"]
        assert set(measured) == {"identity", "reorder", "expert-major"}
        assert all(v > 0 for v in measured.values())
    for rep in doc["replays"]:  # the blocks' shares add up to the replay's own time
        total = sum(b["measured_us_per_token"] for b in rep["blocks"])
        assert total == pytest.approx(rep["measured_us_per_token"], rel=1e-6)
    code, out, err = run_cli(capsys, *run, "--probe")  # the surface measured beside the replay
    assert code == 0, err
    assert "per layer, replayed" in out and "surface fit" in out
    code, _, err = run_cli(capsys, "analyse", model, trace, "--coact-plot", coact)
    assert code == 2 and "needs --plan" in err
    code, _, err = run_cli(capsys, "analyse", model, trace, "--probe")
    assert code == 2 and "needs --measure" in err


def test_analyse_more_bad_input(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, trace = pair
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, _, err = run_cli(capsys, "analyse", model, empty, "--n-expert", "16")
    assert code == 2 and "holds no" in err and len(err.strip().splitlines()) == 1
    # a surface from another device: analysed, with a warning that says so
    cells = [SurfaceCell(s, 1, s / (1e-4 + s / 1e9)) for s in (4096, 65536, 1 << 20)]
    device = {"block_device": "nvme9n9", "model": "Elsewhere SSD", "filesystem": "zfs"}
    far = Surface(cells, engine="pread", device=device).save(tmp_path / "far.surface.json")
    code, out, err = run_cli(capsys, "analyse", model, trace, "--surface", far, "--json")
    assert code == 0, err
    assert "measured on another device" in " ".join(json.loads(out)["notes"])


def test_analyse_refuses_a_layout_the_architecture_cannot_take(
    scattered: Callable[[bool], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from moepack.trace.core import RoutingTrace

    model = scattered(False)  # no gate: nothing to fuse
    ids = np.stack([np.array([[0, 1]]), np.array([[2, 3]])]).astype(np.uint8)
    trace = tmp_path / "t.moetrace"
    save_trace(RoutingTrace(ids=ids, n_expert=4), trace)
    code, _, err = run_cli(capsys, "analyse", model, trace, "--layouts", "fused")
    assert code == 2 and "fusing needs exactly one of each" in err
    assert len(err.strip().splitlines()) == 1
