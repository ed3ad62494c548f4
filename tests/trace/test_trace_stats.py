"""Statistics against brute-force Python on small traces."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from moepack.errors import BadInput
from moepack.trace import RoutingTrace, coactivation, expert_counts, overlap, stats, summarize


@pytest.fixture
def trace() -> RoutingTrace:
    rng = np.random.default_rng(42)
    ids = np.argsort(rng.random((57, 3, 9)), axis=2)[:, :, :3]
    ids[10:20, 1] = ids[9, 1]  # some reuse to make overlap non-trivial
    return RoutingTrace(ids=ids.astype(np.uint8), n_expert=9, prefill_tokens=12)


def rows(trace, lo=0, hi=None):
    hi = trace.tokens if hi is None else hi
    return [[set(trace.ids[t, l_].tolist()) for l_ in range(trace.layers)] for t in range(lo, hi)]


def test_coactivation_matches_brute_force(trace, monkeypatch):
    monkeypatch.setattr(stats, "_CELLS", 7)  # many small chunks
    for layer in range(3):
        want = np.zeros((9, 9), dtype=np.int64)
        for t in range(trace.tokens):
            for a, b in itertools.permutations(trace.ids[t, layer].tolist(), 2):
                want[a, b] += 1
        got = coactivation(trace, layer)
        assert got.dtype == np.int64 and np.array_equal(got, want)
        assert np.array_equal(got, got.T) and not np.diag(got).any()
    dec = coactivation(trace, 0, "decode")
    want = np.zeros((9, 9), dtype=np.int64)
    for t in range(12, 57):
        for a, b in itertools.permutations(trace.ids[t, 0].tolist(), 2):
            want[a, b] += 1
    assert np.array_equal(dec, want)
    with pytest.raises(BadInput, match="trace layer 3 does not exist"):
        coactivation(trace, 3)


def test_expert_counts(trace):
    got = expert_counts(trace)
    for layer in range(3):
        want = np.bincount(trace.ids[:, layer].ravel(), minlength=9)
        assert np.array_equal(got[layer], want)
    assert expert_counts(trace, "prefill").sum() == 12 * 3 * 3


@pytest.mark.parametrize("lag", [1, 3])
@pytest.mark.parametrize("phase", ["all", "decode", "prefill"])
def test_overlap_matches_brute_force(trace, lag, phase, monkeypatch):
    monkeypatch.setattr(stats, "_CELLS", 5)
    lo, hi = {"all": (0, 57), "decode": (12, 57), "prefill": (0, 12)}[phase]
    got = overlap(trace, lag, phase)
    for layer in range(3):
        pairs = [
            len(set(trace.ids[t, layer].tolist()) & set(trace.ids[t - lag, layer].tolist()))
            for t in range(lo + lag, hi)
        ]
        assert got[layer] == pytest.approx(sum(pairs) / (len(pairs) * 3))
    assert np.all(np.isnan(overlap(trace, 60)))


def test_window_distinct_and_distinct(trace):
    got = stats.window_distinct(trace, 10)
    for layer in range(3):
        wins = [len(set(trace.ids[w * 10 : w * 10 + 10, layer].ravel().tolist())) for w in range(5)]
        assert got[layer] == pytest.approx(sum(wins) / 5)
    assert list(stats.distinct_experts(trace)) == [
        len(set(trace.ids[:, l_].ravel().tolist())) for l_ in range(3)
    ]


def test_entropy_and_hot_recall():
    uniform = RoutingTrace(ids=np.arange(8, dtype=np.uint8).reshape(4, 1, 2), n_expert=8)
    assert stats.routing_entropy(uniform)[0] == pytest.approx(3.0)
    assert stats.routing_entropy(uniform, normalized=True)[0] == pytest.approx(1.0)
    assert stats.hot_recall(uniform)[0] == pytest.approx(2 / 8)
    skewed = RoutingTrace(ids=np.array([[[0, 1]], [[0, 1]], [[0, 2]]], np.uint8), n_expert=4)
    p = np.array([3, 2, 1]) / 6
    assert stats.routing_entropy(skewed)[0] == pytest.approx(-(p * np.log2(p)).sum())
    assert stats.hot_recall(skewed)[0] == pytest.approx(5 / 6)


def test_summarize(trace):
    s = summarize(trace, lag=2, window=10, blocks=[4, 5, 6])
    assert [x.block for x in s.layers] == [4, 5, 6]
    assert s.layers[1].overlap == pytest.approx(overlap(trace, 1)[1])
    assert s.layers[1].overlap_lag == pytest.approx(overlap(trace, 2)[1])
    assert set(s.phases) == {"prefill", "decode"}
    assert s.phases["prefill"].tokens == 12 and s.phases["decode"].tokens == 45
    assert s.random_overlap == pytest.approx(3 / 9)
    j = s.to_json()
    assert j["tokens"] == 57 and len(j["per_layer"]) == 3
    assert not math.isnan(j["per_layer"][0]["entropy"])


def test_summarize_notes_what_it_could_not_compute():
    rng = np.random.default_rng(3)
    ids = np.argsort(rng.random((6, 2, 8)), axis=2)[:, :, :2].astype(np.uint8)
    no_prefill = summarize(RoutingTrace(ids=ids, n_expert=8), lag=8)
    assert set(no_prefill.phases) == {"decode"}
    assert no_prefill.notes == [
        "overlap at lag 8 needs at least 9 tokens and the trace has 6: not computed",
        "the trace has no prefill tokens: per-phase statistics cover decode only",
    ]
    assert all(math.isnan(x.overlap_lag) and not math.isnan(x.overlap) for x in no_prefill.layers)
    only_prefill = summarize(RoutingTrace(ids=ids, n_expert=8, prefill_tokens=6), lag=2)
    assert set(only_prefill.phases) == {"prefill"}
    assert only_prefill.notes == [
        "the trace has no decode tokens: per-phase statistics cover prefill only"
    ]
    split = summarize(RoutingTrace(ids=ids, n_expert=8, prefill_tokens=1), lag=2)
    assert split.notes == [
        "prefill has 1 token, too few for overlap at lag 1: not computed",
        "prefill has 1 token, too few for overlap at lag 2: not computed",
    ]
    assert math.isnan(split.phases["prefill"].overlap)
    assert summarize(RoutingTrace(ids=ids, n_expert=8, prefill_tokens=3), lag=2).notes == []
    assert split.to_json()["notes"] == split.notes


def test_an_empty_phase_is_zero_counts_and_nan_rates(trace):
    """Not an error in the library (callers that need the phase refuse it), and not garbage."""
    empty = trace.replace(prefill_tokens=0)
    assert expert_counts(empty, "prefill").sum() == 0
    assert coactivation(empty, 0, "prefill").sum() == 0
    assert np.all(np.isnan(overlap(empty, 1, "prefill")))
    assert np.all(np.isnan(stats.hot_recall(empty, "prefill")))
    assert np.all(np.isnan(stats.routing_entropy(empty, "prefill")))
    assert np.all(np.isnan(stats.window_distinct(empty, 4, "prefill")))
