"""Fixtures for the trace tests: tiny real GGUF models and small synthetic traces."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moepack.checkpoint import MoeModel
from moepack.checkpoint.synth import SynthSpec, synth_model
from moepack.trace import RoutingTrace, synth_trace

CREATED = "2026-01-01T00:00:00Z"


def tiny_spec(**kw: object) -> SynthSpec:
    base: dict[str, object] = dict(
        layers=3,
        experts=8,
        top_k=2,
        hidden=64,
        expert_ffn=32,
        heads=2,
        kv_heads=1,
        head_dim=32,
        vocab=262,
    )
    base.update(kw)
    return SynthSpec(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A qwen3moe model with 3 MoE blocks (0-2), 8 experts, top-2."""
    d = tmp_path_factory.mktemp("model")
    return synth_model(d / "tiny.gguf", tiny_spec()).paths[0]


@pytest.fixture(scope="session")
def other_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shape as ``model_path``, other weights: another fingerprint."""
    d = tmp_path_factory.mktemp("model2")
    return synth_model(d / "other.gguf", tiny_spec(seed=7)).paths[0]


@pytest.fixture(scope="session")
def wide_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 MoE blocks of 16 experts, top-4."""
    d = tmp_path_factory.mktemp("model3")
    return synth_model(d / "wide.gguf", tiny_spec(experts=16, top_k=4)).paths[0]


@pytest.fixture
def model(model_path: Path):
    with MoeModel(model_path) as m:
        yield m


@pytest.fixture
def rich_trace() -> RoutingTrace:
    """Everything a trace can hold: weights, prefill, block map, fingerprint, provenance."""
    t = synth_trace(
        tokens=240,
        layers=3,
        n_expert=8,
        top_k=2,
        prefill_tokens=17,
        weights=True,
        seed=5,
        created=CREATED,
    )
    return t.replace(block_map=[1, 3, 4], model_fingerprint="0123456789abcdef" * 2)


@pytest.fixture
def plain_trace() -> RoutingTrace:
    """Only ids and the expert count: what every format carries."""
    rng = np.random.default_rng(1)
    ids = np.argsort(rng.random((50, 4, 20)), axis=2)[:, :, :3].astype(np.uint16)
    return RoutingTrace(ids=ids, n_expert=20)
