"""RoutingTrace: validation on construction, block maps, and binding to a real model."""

from __future__ import annotations

import numpy as np
import pytest

from moepack.blocklist import format_index_list, parse_index_list
from moepack.checkpoint import MoeModel
from moepack.errors import BadInput
from moepack.trace import RoutingTrace, default_block_map, synth_trace
from moepack.trace.core import NEED_BLOCK_MAP, TraceNeeds


def ids_of(tokens: int = 6, layers: int = 3, k: int = 2, n: int = 8, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((tokens, layers, n)), axis=2)[:, :, :k].astype(np.uint8)


def test_valid_trace_and_shape():
    t = RoutingTrace(ids=ids_of(), n_expert=8, prefill_tokens=2)
    assert (t.tokens, t.layers, t.k, t.decode_tokens) == (6, 3, 2, 4)
    assert t.phase_range("decode") == slice(2, 6)
    assert list(t.layer_max) == list(ids_of().max(axis=(0, 2)))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"ids": np.zeros((4, 2), np.uint8)}, "shape [tokens, layers, k]"),
        ({"ids": np.zeros((4, 2, 2), np.float32)}, "must be integers"),
        ({"ids": np.zeros((0, 2, 2), np.uint8)}, "no tokens"),
        ({"n_expert": 0}, "expert count must be >= 1"),
        ({"n_expert": 1}, "only 1 experts"),
        ({"prefill_tokens": 7}, "prefill of 7 tokens"),
        ({"block_map": [0, 1]}, "block map has 2 entries"),
        ({"block_map": [0, 1, 1]}, "names a block twice"),
        ({"block_map": [0, -1, 2]}, "negative block"),
        ({"model_fingerprint": "xyz"}, "not a hex string"),
        ({"weights": np.zeros((6, 3, 3), np.float32)}, "router weights have shape"),
    ],
)
def test_construction_rejects(kwargs, needle):
    args = {"ids": ids_of(), "n_expert": 8, **kwargs}
    with pytest.raises(BadInput, match=None) as exc:
        RoutingTrace(**args)
    assert needle in str(exc.value)


def test_ids_out_of_range_named_by_token_and_layer():
    ids = ids_of()
    ids[4, 1, 1] = 8
    ids[4, 1, 0] = 0
    with pytest.raises(BadInput) as exc:
        RoutingTrace(ids=ids, n_expert=8)
    assert "token 4 layer 1: expert id 8 is out of range for 8 experts" in str(exc.value)


def test_negative_ids_rejected():
    ids = ids_of().astype(np.int64)
    ids[2, 0, 0] = -3
    with pytest.raises(BadInput, match="token 2 layer 0 slot 0: negative expert id -3"):
        RoutingTrace(ids=ids, n_expert=8)


def test_duplicate_expert_in_a_row_rejected():
    ids = ids_of()
    ids[3, 2] = [5, 5]
    with pytest.raises(BadInput, match=r"token 3 layer 2: expert chosen twice in one row \[5, 5\]"):
        RoutingTrace(ids=ids, n_expert=8)


def test_non_finite_weights_rejected():
    w = np.full((6, 3, 2), 0.5, np.float32)
    w[1, 2, 0] = np.nan
    with pytest.raises(BadInput, match="token 1 layer 2 slot 0: router weight is not finite"):
        RoutingTrace(ids=ids_of(), n_expert=8, weights=w)


def test_validation_walks_chunks(monkeypatch):
    """A bad id far from the start is found even when validation reads tiny chunks."""
    import moepack.trace.core as core

    monkeypatch.setattr(core, "CHUNK_CELLS", 6)
    ids = ids_of(tokens=500)
    ids[437, 0] = [7, 7]
    with pytest.raises(BadInput, match="token 437 layer 0"):
        RoutingTrace(ids=ids, n_expert=8)


def test_parse_and_describe_block_maps():
    assert parse_index_list("0-3,5", what="block map") == [0, 1, 2, 3, 5]
    assert parse_index_list(" 7 ", what="block map") == [7]
    assert format_index_list([0, 1, 2, 3, 5, 7, 8], ", ") == "0-3, 5, 7-8"
    for bad in ("", "a", "3-1", "1,,x"):
        with pytest.raises(BadInput):
            parse_index_list(bad, what="block map")


def test_default_block_map_needs_exact_count(model):
    assert default_block_map(model, 3) == [0, 1, 2]
    with pytest.raises(TraceNeeds, match="has no block map, and .* has 3 MoE blocks") as exc:
        default_block_map(model, 2)
    assert exc.value.need == NEED_BLOCK_MAP
    assert "vs 2 trace layers" in str(exc.value) and "--" not in str(exc.value)
    with pytest.raises(TraceNeeds, match="has 3 MoE blocks .* vs 4 trace layers"):
        default_block_map(model, 4)


def test_check_against_accepts_a_fitting_trace(model):
    t = RoutingTrace(ids=ids_of(), n_expert=8)
    assert t.check_against(model) == [0, 1, 2]
    bound = t.bound_to(model)
    assert bound.model_fingerprint == model.fingerprint
    assert bound.block_map == [0, 1, 2]
    assert bound.check_against(model) == [0, 1, 2]
    explicit = RoutingTrace(ids=ids_of(layers=2), n_expert=8, block_map=[2, 0])
    assert explicit.check_against(model) == [2, 0]


def test_check_against_fingerprint_of_another_model(model, other_model_path):
    t = RoutingTrace(ids=ids_of(), n_expert=8).bound_to(model)
    with MoeModel(other_model_path) as other, pytest.raises(BadInput) as exc:
        t.check_against(other)
    msg = str(exc.value)
    assert model.fingerprint in msg and "another model" in msg


def test_check_against_block_map_naming_a_non_moe_block(model):
    t = RoutingTrace(ids=ids_of(layers=2), n_expert=8, block_map=[0, 5])
    with pytest.raises(BadInput) as exc:
        t.check_against(model)
    assert "trace layer 1 to block 5, which is not a MoE block" in str(exc.value)
    assert "MoE blocks: 0-2" in str(exc.value)


def test_check_against_layer_count_without_map(model):
    t = RoutingTrace(ids=ids_of(layers=2), n_expert=8)
    with pytest.raises(TraceNeeds, match="which blocks the trace covers is unknown"):
        t.check_against(model)


def test_check_against_expert_count_and_k(model, wide_model_path):
    with pytest.raises(BadInput, match="trace has 16 experts per layer but block 0"):
        RoutingTrace(ids=ids_of(n=16), n_expert=16).check_against(model)
    with pytest.raises(BadInput, match="routes 3 experts per token but block 0 .* top-2"):
        RoutingTrace(ids=ids_of(k=3), n_expert=8).check_against(model)
    # ids fit 16 experts, but the trace was declared for 8: a different routing space
    with (
        MoeModel(wide_model_path) as wide,
        pytest.raises(BadInput, match="trace has 8 experts per layer but block 0"),
    ):
        RoutingTrace(ids=ids_of(k=4), n_expert=8).check_against(wide)


def test_path_named_in_errors(tmp_path):
    with pytest.raises(BadInput) as exc:
        RoutingTrace(ids=ids_of(), n_expert=8, prefill_tokens=99, path=tmp_path / "x.moetrace")
    assert str(exc.value).startswith(str(tmp_path / "x.moetrace") + ": ")


def test_replace_revalidates():
    t = synth_trace(tokens=20, layers=2, n_expert=8, top_k=2, created="x")
    with pytest.raises(BadInput):
        t.replace(n_expert=4)
    assert t.replace(prefill_tokens=5).prefill_tokens == 5
