"""store build leaves nothing behind on bad input or an interrupt, and refuses what it cannot
make into a store."""

from __future__ import annotations

import numpy as np
import pytest

from moefixtures import ambiguous_model, run_cli, tiny_spec, write_gguf
from moepack.checkpoint import MoeModel
from moepack.checkpoint.synth import synth_model
from moepack.errors import BadInput
from moepack.layout.plan import LayerPlan, Plan
from moepack.store.build import build_store


class InterruptAfterFirstChunk:
    """A progress sink that raises KeyboardInterrupt (what Ctrl-C raises) once bytes move."""

    def start(self, description: str, total: int, unit: str = "B") -> None:
        pass

    def advance(self, amount: int) -> None:
        raise KeyboardInterrupt

    def finish(self) -> None:
        pass


def test_an_interrupted_build_leaves_nothing(tmp_path):
    model = synth_model(tmp_path / "m.gguf", tiny_spec()).paths[0]
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(KeyboardInterrupt):
        build_store(model, tmp_path / "s.moestore", progress=InterruptAfterFirstChunk())
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_refusals_write_nothing(tmp_path):
    model = synth_model(tmp_path / "m.gguf", tiny_spec()).paths[0]
    other = synth_model(tmp_path / "o.gguf", tiny_spec(seed=4)).paths[0]
    with MoeModel(other) as m:
        foreign = Plan([LayerPlan(0, np.arange(8)[::-1].copy())], m.fingerprint)
    dense = write_gguf(
        tmp_path / "dense.gguf",
        "qwen3moe",
        {"blk.0.ffn_up.weight": (32, 16)},
        {"qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2},
    )
    before = sorted(p.name for p in tmp_path.iterdir())
    out = tmp_path / "s.moestore"
    with pytest.raises(BadInput, match="fingerprint"):
        build_store(model, out, plan=foreign)
    with pytest.raises(BadInput, match="power of two"):
        build_store(model, out, alignment=6000)
    with pytest.raises(BadInput, match="alignment must be 4096"):
        build_store(model, out, alignment=512)
    with pytest.raises(BadInput, match="no MoE blocks"):
        build_store(dense, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_block_with_an_unclassified_tensor_needs_a_decision(tmp_path, capsys):
    model = ambiguous_model(tmp_path / "a.gguf")
    out = tmp_path / "a.moestore"
    code, _, err = run_cli(capsys, "store", "build", model, "--out", out, "-q")
    assert code == 2 and "blk.0.ffn_odd.weight" in err and "--assume" in err
    assert not out.exists()
    flag = ["--assume-not-expert", "blk.0.ffn_odd.weight"]
    code, _, err = run_cli(capsys, "store", "build", model, "--out", out, *flag, "-q")
    assert code == 0, err
    code, _, err = run_cli(capsys, "store", "verify", out, model, "-q")  # no flag needed
    assert code == 0, err
