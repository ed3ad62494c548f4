"""Fixtures for the trace tests: tiny real GGUF models and small synthetic traces."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moefixtures import tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.synth import synth_model
from moepack.trace import RoutingTrace, synth_trace

CREATED = "2026-01-01T00:00:00Z"
LAYERS = 3  # MoE blocks of the test models (moefixtures.tiny_spec defaults to 2)


@pytest.fixture(scope="session")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A qwen3moe model with 3 MoE blocks (0-2), 8 experts, top-2."""
    d = tmp_path_factory.mktemp("model")
    return synth_model(d / "tiny.gguf", tiny_spec(layers=LAYERS)).paths[0]


@pytest.fixture(scope="session")
def other_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shape as ``model_path``, other weights: another fingerprint."""
    d = tmp_path_factory.mktemp("model2")
    return synth_model(d / "other.gguf", tiny_spec(layers=LAYERS, seed=7)).paths[0]


@pytest.fixture(scope="session")
def wide_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 MoE blocks of 16 experts, top-4."""
    d = tmp_path_factory.mktemp("model3")
    return synth_model(d / "wide.gguf", tiny_spec(layers=LAYERS, experts=16, top_k=4)).paths[0]


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
