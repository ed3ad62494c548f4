"""``moepack survey`` (config.json alone, the built-in table) and ``moepack advise``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moefixtures import run_cli, synth_with_trace
from moepack.errors import BadInput
from moepack.layout.known_families import KNOWN
from moepack.layout.survey import family_from_config
from moepack.storage.surface import Surface, SurfaceCell


def slow_small_reads(folder: Path) -> Path:
    """A device where a request costs 1 ms and streaming runs at 1 GB/s, at depths 1 and 8."""
    cells = [
        SurfaceCell(s, qd, min(qd, 4) * s / (1e-3 + s / 1e9))
        for s in (4096, 65536, 1 << 20, 16 << 20)
        for qd in (1, 8)
    ]
    return Surface(cells, engine="pread").save(folder / "slow.surface.json")


def test_survey_of_a_config_computes_the_slice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "text_config": {
                    "hidden_size": 2048,
                    "moe_intermediate_size": 768,
                    "num_experts": 128,
                    "num_experts_per_tok": 8,
                    "num_hidden_layers": 48,
                }
            }
        )
    )
    code, out, err = run_cli(capsys, "survey", cfg, "--bits", "4", "--json")
    assert code == 0, err
    row = json.loads(out)["rows"][0]
    assert row["slice_kib"] == 2048 * 768 * 4 / 8 / 1024
    assert row["bytes_per_token"] == 2048 * 768 * 4 / 8 * 3 * 8 * 48
    assert row["best_gain"] is None


def test_survey_known_table_names_a_source_for_every_family(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(
        capsys, "survey", "--known", "--surface", slow_small_reads(tmp_path), "--json"
    )
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert len(rows) == len(KNOWN) >= 13
    assert all(r["source"] for r in rows)
    by = {r["name"]: r for r in rows}
    # the peer's figures at 4.5 bits: granite 288 KiB, Mixtral 32,256 KiB
    assert by["granite-3.0-1b-a400m"]["slice_kib"] == 288
    assert by["Mixtral-8x7B"]["slice_kib"] == 32256
    # on a 1 ms-per-request device small slices gain far more from layout than huge ones
    assert by["granite-3.0-1b-a400m"]["best_gain"] > by["Mixtral-8x7B"]["best_gain"] > 1


def test_survey_bad_config_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "dense.json"
    cfg.write_text(json.dumps({"hidden_size": 4096, "num_hidden_layers": 32}))
    code, _, err = run_cli(capsys, "survey", cfg)
    assert code == 2 and "not a MoE model" in err
    code, _, err = run_cli(capsys, "survey")
    assert code == 2 and "--known" in err
    bad: dict[str, object] = {
        "hidden_size": 8,
        "moe_intermediate_size": 8,
        "num_experts_per_tok": 2,
    }
    bad |= {"num_hidden_layers": 2, "num_experts": "many", "architectures": 5}
    cfg.write_text(json.dumps(bad))
    code, _, err = run_cli(capsys, "survey", cfg)
    assert code == 2 and "num_experts" in err and "Traceback" not in err
    cfg.write_text(json.dumps(bad | {"num_experts": 4, "first_k_dense_replace": "x"}))
    code, _, err = run_cli(capsys, "survey", cfg)
    assert code == 2 and "first_k_dense_replace" in err and "Traceback" not in err
    with pytest.raises(BadInput, match="folder"):
        family_from_config(tmp_path)


def test_advise_ranks_layouts_and_names_depth_and_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, trace = synth_with_trace(capsys, tmp_path, "--layers", "2", "--tokens", "800")
    surface = slow_small_reads(tmp_path)
    code, out, err = run_cli(capsys, "advise", model, trace, "--surface", surface, "--json")
    assert code == 0, err
    advice = json.loads(out)["advice"]
    titles = [a["title"] for a in advice]
    assert titles[0].startswith("build an expert-major store")
    # qwen3moe's llama.cpp loader takes no fused gate+up: never advised as a drop-in rewrite
    drop_ins = [t for t in titles if "expert-major" not in t]
    assert not any("fuse" in t for t in drop_ins)
    assert any("does not take a fused" in n for n in json.loads(out)["notes"])
    speedups = [a["figures"]["speedup"] for a in advice if "speedup" in a["figures"]]
    assert speedups == sorted(speedups, reverse=True) and speedups[0] > 1.05
    depth = next(a for a in advice if a["title"].startswith("read with queue depth"))
    assert depth["figures"]["queue_depth"] == 8
    cache = next(a for a in advice if a["title"].startswith("per-block expert cache"))
    sizes = [n for n in cache["figures"]["experts_for_hit_rate"].values() if n]
    assert sizes == sorted(sizes)
