"""Synthetic traces: the planted structure is there, at the requested strength, and the
recorded ground truth describes it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from moepack.checkpoint import MoeModel
from moepack.errors import BadInput
from moepack.trace import (
    RoutingTrace,
    SynthTruth,
    TraceStructure,
    coactivation,
    default_clusters,
    overlap,
    synth_trace,
    synth_truth,
)

SIZES: dict[str, Any] = dict(layers=3, n_expert=64, top_k=4, created="2026-01-01T00:00:00Z")


def planted(trace: RoutingTrace) -> SynthTruth:
    """The structure ``trace`` was synthesised with (a synthetic trace always records it)."""
    truth = synth_truth(trace)
    assert truth is not None
    return truth


def modal_cluster_share(ids: np.ndarray, cluster_of: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per (token, layer): the most common cluster among the k experts, and its share."""
    T, L, k = ids.shape
    cl = cluster_of[np.arange(L)[None, :, None], ids]  # [T, L, k]
    C = int(cluster_of.max()) + 1
    counts = np.zeros((T, L, C), dtype=np.int64)
    np.put_along_axis(counts, cl, 0, axis=2)
    for j in range(k):
        np.add.at(counts, (np.arange(T)[:, None], np.arange(L)[None, :], cl[:, :, j]), 1)
    return counts.argmax(axis=2), counts.max(axis=2) / k


def test_deterministic_by_seed():
    a = synth_trace(tokens=500, seed=11, weights=True, **SIZES)
    b = synth_trace(tokens=500, seed=11, weights=True, **SIZES)
    c = synth_trace(tokens=500, seed=12, weights=True, **SIZES)
    assert a.weights is not None and b.weights is not None
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.weights, b.weights)
    assert a.provenance == b.provenance
    assert not np.array_equal(a.ids, c.ids)


def test_shape_and_recorded_truth():
    t = synth_trace(
        tokens=300, prefill_tokens=40, structure=TraceStructure(clusters=4), seed=1, **SIZES
    )
    assert t.ids.shape == (300, 3, 4) and t.ids.dtype == np.uint8
    assert t.prefill_tokens == 40 and t.n_expert == 64
    truth = planted(t)
    assert truth is not None and truth.clusters == 4
    assert truth.cluster_of.shape == (3, 64)
    for layer in range(3):
        sizes = sorted(len(m) for m in truth.members(layer))
        assert sizes == [16, 16, 16, 16]
        order = truth.clustered_order(layer)
        assert sorted(order.tolist()) == list(range(64))
        assert np.all(np.diff(truth.cluster_of[layer, order]) >= 0)
    assert t.provenance["synth"]["params"]["persistence"] == 0.4


@pytest.mark.parametrize("p", [0.0, 0.38, 0.7, 1.0])
def test_persistence_is_the_requested_rate(p):
    t = synth_trace(tokens=4000, structure=TraceStructure(persistence=p), seed=3, **SIZES)
    measured = overlap(t, 1, "decode")
    assert np.all(np.abs(measured - p) < 0.02), measured


def test_overlap_decays_with_lag_but_stays_above_random():
    t = synth_trace(tokens=6000, structure=TraceStructure(persistence=0.4), seed=4, **SIZES)
    lag1, lag8 = overlap(t, 1).mean(), overlap(t, 8).mean()
    random_level = 4 / 64
    assert lag1 > lag8 > 1.5 * random_level


def test_prefill_routes_wide():
    t = synth_trace(
        tokens=3000, prefill_tokens=1000, structure=TraceStructure(clusters=4), seed=5, **SIZES
    )
    assert np.all(overlap(t, 1, "prefill") == 0.0)  # fresh every token, outside the previous set
    truth = planted(t)
    _, share = modal_cluster_share(np.asarray(t.ids), truth.cluster_of)
    assert share[1000:].mean() > share[:1000].mean() + 0.2


def test_within_token_locality():
    strong = synth_trace(
        tokens=3000, structure=TraceStructure(locality=0.95, clusters=4), seed=6, **SIZES
    )
    none = synth_trace(
        tokens=3000, structure=TraceStructure(locality=0.0, clusters=4), seed=6, **SIZES
    )
    s1 = modal_cluster_share(np.asarray(strong.ids), planted(strong).cluster_of)[1].mean()
    s0 = modal_cluster_share(np.asarray(none.ids), planted(none).cluster_of)[1].mean()
    assert s1 > 0.85
    assert s0 < 0.6  # four clusters, four picks: chance level is about 0.5


@pytest.mark.parametrize(("locality", "factor"), [(0.8, 4), (0.9, 7)])
def test_coactivation_within_clusters_far_above_across_and_recoverable(locality, factor):
    t = synth_trace(
        tokens=6000, structure=TraceStructure(clusters=4, locality=locality), seed=7, **SIZES
    )
    truth = planted(t)
    for layer in range(3):
        co = coactivation(t, layer)
        same = truth.cluster_of[layer][:, None] == truth.cluster_of[layer][None, :]
        off_diag = ~np.eye(64, dtype=bool)
        within = co[same & off_diag].mean()
        across = co[~same].mean()
        assert within > factor * across, (within, across)
        # each expert's 15 strongest partners are mostly its own cluster-mates
        partners = np.argsort(-co, axis=1)[:, :15]
        hit = (truth.cluster_of[layer][partners] == truth.cluster_of[layer][:, None]).mean()
        assert hit > 0.9


def test_identity_order_is_not_already_clustered():
    t = synth_trace(tokens=4000, structure=TraceStructure(clusters=4), seed=8, **SIZES)
    truth = planted(t)
    for layer in range(3):
        cl = truth.cluster_of[layer]
        same_adjacent = (cl[1:] == cl[:-1]).mean()
        assert same_adjacent < 0.5  # random order: about 15/63; clustered: 60/63
        co = coactivation(t, layer)
        ident = co[np.arange(63), np.arange(1, 64)].sum()
        order = truth.clustered_order(layer)
        best = co[order[:-1], order[1:]].sum()
        assert best > 2 * ident
    # different layers get different shuffles
    assert not np.array_equal(truth.cluster_of[0], truth.cluster_of[1])


def test_layer_coupling():
    kw = dict(tokens=3000, seed=9, **SIZES)
    coupled = synth_trace(
        structure=TraceStructure(clusters=4, locality=0.95, layer_coupling=0.95), **kw
    )
    free = synth_trace(
        structure=TraceStructure(clusters=4, locality=0.95, layer_coupling=0.0), **kw
    )

    def agreement(t):
        modal, _ = modal_cluster_share(np.asarray(t.ids), planted(t).cluster_of)
        return (modal[:, 1:] == modal[:, :-1]).mean()

    assert agreement(coupled) > 0.8
    assert agreement(free) < 0.45  # about 1/4 by chance


def test_weights_are_normalised_and_ranked():
    t = synth_trace(tokens=200, weights=True, seed=2, **SIZES)
    w = np.asarray(t.weights)
    assert w.dtype == np.float32
    assert np.allclose(w.sum(axis=2), 1.0, atol=1e-5)
    assert np.all(np.diff(w, axis=2) <= 0)


@pytest.mark.parametrize(
    ("n", "k", "clusters"), [(8, 8, 1), (12, 8, 2), (9, 1, 3), (5, 2, None), (300, 3, 7)]
)
def test_corner_sizes_stay_valid(n, k, clusters):
    t = synth_trace(
        tokens=400,
        layers=2,
        n_expert=n,
        top_k=k,
        structure=TraceStructure(clusters=clusters),
        prefill_tokens=10,
        seed=1,
    )
    assert t.ids.shape == (400, 2, k)
    assert int(np.asarray(t.ids).max()) < n
    srt = np.sort(np.asarray(t.ids), axis=2)
    assert not (srt[:, :, 1:] == srt[:, :, :-1]).any()


def test_default_clusters():
    assert default_clusters(128, 8) == 5
    assert default_clusters(16, 4) == 2
    assert default_clusters(8, 8) == 1


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(locality=1.5), "locality must be between 0 and 1"),
        (dict(persistence=-0.1), "persistence must be between 0 and 1"),
        (dict(prefill_tokens=11), "prefill_tokens must be between 0 and 10"),
        (dict(clusters=65), "clusters must be between 1 and n_expert"),
        (dict(top_k=65), "top_k must be between 1 and n_expert"),
        (dict(tokens=0), "tokens and layers must be >= 1"),
        (dict(seed=-1), "seed must be >= 0"),
    ],
)
def test_bad_parameters(kwargs, needle):
    planted = {
        k: kwargs.pop(k) for k in list(kwargs) if k in {"locality", "persistence", "clusters"}
    }
    args = {"tokens": 10, **SIZES, **kwargs}
    with pytest.raises(BadInput, match=needle):
        synth_trace(**args, structure=TraceStructure(**planted))


def test_needs_sizes_or_a_model():
    with pytest.raises(BadInput, match="give a model, or layers, n_expert and top_k"):
        synth_trace(tokens=10, layers=2)


def test_for_a_model_is_bound_to_it(model_path, other_model_path):
    with MoeModel(model_path) as m:
        t = synth_trace(m, tokens=300, seed=1, created="x")
        assert (t.layers, t.n_expert, t.k) == (3, 8, 2)
        assert t.block_map == [0, 1, 2] and t.model_fingerprint == m.fingerprint
        assert t.check_against(m) == [0, 1, 2]
        assert t.provenance["model"]
        with pytest.raises(BadInput, match="top_k=4, but the model has 2"):
            synth_trace(m, tokens=10, top_k=4)
    with MoeModel(other_model_path) as other, pytest.raises(BadInput, match="another model"):
        t.check_against(other)


def test_same_trace_whatever_the_thread_count(monkeypatch):
    import moepack.trace.synth as synth_mod

    monkeypatch.setattr(synth_mod, "_MAX_THREADS", 1)
    one = synth_trace(tokens=400, seed=21, **{**SIZES, "layers": 5})
    monkeypatch.setattr(synth_mod, "_MAX_THREADS", 4)
    monkeypatch.setattr(synth_mod.os, "cpu_count", lambda: 4)
    four = synth_trace(tokens=400, seed=21, **{**SIZES, "layers": 5})
    assert np.array_equal(one.ids, four.ids)
    assert one.provenance["synth"] == four.provenance["synth"]
