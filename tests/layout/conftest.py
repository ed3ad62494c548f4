"""Fixtures of the layout suite: small real GGUF models written by gguf-py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from moefixtures import tiny_spec, write_gguf
from moepack.checkpoint.synth import synth_model


@pytest.fixture(scope="session")
def qwen_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic qwen3moe model: 2 MoE blocks, 8 experts, top-2, gate/up/down per block."""
    d = tmp_path_factory.mktemp("layout-model")
    return synth_model(d / "tiny.gguf", tiny_spec()).paths[0]


@pytest.fixture
def scattered(tmp_path: Path) -> Callable[[bool], Path]:
    """``scattered(gated)``: the path of a fresh ``scattered_model``."""

    def make(gated: bool = True) -> Path:
        return scattered_model(tmp_path / f"scattered-{gated}.gguf", gated)

    return make


def scattered_model(path: Path, gated: bool = True) -> Path:
    """One MoE block whose expert tensors sit in alphabetical order with a dense tensor between
    them (down, gate, norm, up), as converters often write them: pipeline has work to do."""
    e, f, n = 4, 32, 64
    tensors: dict[str, tuple[int, ...]] = {"blk.0.ffn_down_exps.weight": (e, n, f)}
    if gated:
        tensors["blk.0.ffn_gate_exps.weight"] = (e, f, n)
    tensors["blk.0.ffn_gate_inp.weight"] = (e, n)
    tensors["blk.0.ffn_norm.weight"] = (n,)
    tensors["blk.0.ffn_up_exps.weight"] = (e, f, n)
    kv: dict[str, object] = {
        "qwen3moe.expert_count": e,
        "qwen3moe.expert_used_count": 2,
        "qwen3moe.block_count": 1,
    }
    return write_gguf(path, "qwen3moe", tensors, kv)
