"""Fixtures of the streaming suite: a small real GGUF, its expert-major store, and traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from moefixtures import tiny_spec
from moepack.checkpoint.model import MoeModel
from moepack.checkpoint.synth import synth_model
from moepack.store.build import build_store
from moepack.trace import save_trace, synth_trace


@pytest.fixture(scope="session")
def streamed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A qwen3moe model (2 MoE blocks, 16 experts, top-4), its store, a bound trace of 600
    tokens with 3 prompts, and another model of the same shape (other weights)."""
    d = tmp_path_factory.mktemp("stream")
    model = synth_model(d / "m.gguf", tiny_spec(experts=16, top_k=4)).paths[0]
    other = synth_model(d / "other.gguf", tiny_spec(experts=16, top_k=4, seed=7)).paths[0]
    build_store(model, d / "m.moestore")
    with MoeModel(model) as m:
        t = synth_trace(m, tokens=600, seed=3)
    t = t.replace(prefill_tokens=0, segments=[(0, 50, 150), (200, 50, 150), (400, 50, 150)])
    save_trace(t, d / "t.moetrace")
    return {"model": model, "store": d / "m.moestore", "trace": d / "t.moetrace", "other": other}
