"""The LRU hit-rate curve from stack distances equals a brute-force LRU simulation exactly."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from moepack.trace import synth_trace
from moepack.trace.stackdist import hit_curve, popcount, stack_distances, token_masks


def lru_hits(ids: np.ndarray, capacity: int) -> np.ndarray:
    """``[tokens, k]`` bool: which accesses an LRU cache of ``capacity`` experts hits, with the
    experts of each token accessed in router order."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = np.zeros(ids.shape, dtype=bool)
    for t in range(ids.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            if e in cache:
                hits[t, s] = True
                cache.move_to_end(e)
            else:
                cache[e] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits


@pytest.mark.parametrize(
    ("n_expert", "k", "tokens", "seed"),
    [(8, 2, 60, 0), (65, 4, 200, 1), (130, 8, 150, 2), (16, 1, 120, 3), (200, 6, 90, 4)],
)
def test_hit_curve_equals_brute_force_lru(n_expert: int, k: int, tokens: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    # a skewed, sticky stream: real caches see repeats, not only uniform draws
    pool = rng.permutation(n_expert)[: max(k, n_expert // 2)]
    ids = np.stack([rng.choice(pool, k, replace=False) for _ in range(tokens)])
    d = stack_distances(ids, n_expert)
    for chunk in (1, 7, 64):  # expert reuse across chunk boundaries is exact too
        assert np.array_equal(stack_distances(ids, n_expert, chunk_tokens=chunk), d)
    curve = hit_curve(d, n_expert)
    assert np.array_equal(d >= 0, lru_hits(ids, n_expert))  # warm = seen before
    for capacity in range(1, n_expert + 1):
        hits = lru_hits(ids, capacity)
        assert np.array_equal((d >= 0) & (d < capacity), hits), capacity
        assert curve[capacity - 1] == hits.mean()


def test_synthetic_trace_decode_curve_equals_brute_force() -> None:
    from moepack.trace.routing_stats import routing_stats

    trace = synth_trace(tokens=400, layers=2, n_expert=24, top_k=3, prefill_tokens=50, seed=5)
    stats = routing_stats(trace)
    for layer in range(2):
        ids = np.asarray(trace.ids[:, layer, :])
        for capacity in (1, 3, 7, 24):
            hits = lru_hits(ids, capacity)
            got_all = stats.phases["all"].layers[layer].lru_hit_rate[capacity - 1]
            got_decode = stats.phases["decode"].layers[layer].lru_hit_rate[capacity - 1]
            assert got_all == hits.mean()
            assert got_decode == hits[50:].mean()  # the cache has seen the prefill


def test_masks_and_popcount() -> None:
    ids = np.array([[0, 5], [63, 64], [127, 1]])
    masks = token_masks(ids, 128)
    assert masks.shape == (3, 2)
    assert popcount(masks).tolist() == [2, 2, 2]
    assert popcount(masks[0:1] & token_masks(np.array([[5, 9]]), 128)).tolist() == [1]
