"""Cache policies: LRU equals the exact stack-distance curve of ``trace stats``, Belady is
never beaten, and every policy's slot bookkeeping is a real cache."""

from __future__ import annotations

import numpy as np
import pytest

from moepack.errors import BadInput
from moepack.stream.budget import CacheBudget
from moepack.stream.simulate import HitRates, layer_hits, lru_hits_by_size, run_layer
from moepack.trace import synth_trace
from moepack.trace.cache_policy import POLICIES
from moepack.trace.routing_stats import routing_stats


def traces() -> list[np.ndarray]:
    """Planted-structure and structureless layer streams ``[tokens, k]``."""
    planted = synth_trace(tokens=1500, layers=1, n_expert=32, top_k=4, seed=1)
    rng = np.random.default_rng(2)
    iid = np.stack([rng.choice(32, 4, replace=False) for _ in range(1500)])
    return [np.asarray(planted.ids[:, 0, :]), iid]


def test_lru_matches_the_stack_distance_curve_of_trace_stats() -> None:
    trace = synth_trace(tokens=3000, layers=2, n_expert=32, top_k=4, prefill_tokens=300, seed=4)
    stats = routing_stats(trace)
    lru = POLICIES.get("lru")
    decode = trace.phase_mask("decode")
    for layer in range(2):
        ids = np.asarray(trace.ids[:, layer, :])
        for cap in range(4, 33):
            rates = HitRates.of(run_layer(lru, ids, cap, 32).hits, decode)
            curve_all = stats.phases["all"].layers[layer].lru_hit_rate[cap - 1]
            curve_decode = stats.phases["decode"].layers[layer].lru_hit_rate[cap - 1]
            assert abs(rates.lifetime - curve_all) < 0.001
            assert rates.decode is not None and abs(rates.decode - curve_decode) < 0.001
            # one pass of stack distances gives exactly the simulated hits
            assert np.array_equal(
                lru_hits_by_size(ids, 32, [cap])[0], layer_hits(lru, ids, cap, 32)
            )


@pytest.mark.parametrize("which", [0, 1])
def test_belady_is_never_beaten(which: int) -> None:
    ids = traces()[which]
    belady = POLICIES.get("belady")
    for cap in (4, 6, 9, 16, 24):
        best = int(run_layer(belady, ids, cap, 32).hits.sum())
        for p in POLICIES:
            learned = p.fit(ids, 32, cap)
            assert int(run_layer(p, ids, cap, 32, learned).hits.sum()) <= best, (p.name, cap)
    assert int(run_layer(belady, ids, 32, 32).hits.sum()) == ids.size - 32  # only cold misses


@pytest.mark.parametrize("name", POLICIES.names())
def test_slots_are_a_consistent_cache(name: str) -> None:
    """Replaying the slots a policy hands out: a hit finds its expert where it was put, a
    miss never lands outside the capacity, and nothing hits before its first load."""
    ids = traces()[0]
    policy = POLICIES.get(name)
    cap = 7
    run = run_layer(policy, ids, cap, 32, policy.fit(ids, 32, cap))
    held: dict[int, int] = {}  # slot -> expert
    for e, slot in zip(ids.ravel().tolist(), run.slots.ravel().tolist(), strict=True):
        if slot < 0:
            assert e in held.values()
        else:
            assert 0 <= slot < cap and e not in held.values()
            held[slot] = e
    assert 0 < run.hits.mean() < 1


def test_a_budget_below_top_k_is_refused_naming_the_minimum() -> None:
    with pytest.raises(BadInput, match=r"minimum is 4 slots per layer \(4608 bytes\)"):
        CacheBudget(bytes=2000).slots_per_layer([256, 256, 384], 4, [16, 16, 16])
    with pytest.raises(BadInput, match="fewer than the top-4"):
        CacheBudget(slots=3).slots_per_layer([256], 4, [16])
    assert CacheBudget(bytes=3 * 8 * 384).slots_per_layer([256, 384, 384], 4, [16, 16, 16]) == [
        12,
        8,
        8,
    ]
    with pytest.raises(BadInput, match="give one"):
        CacheBudget(bytes=1, slots=1)


def test_prefetch_reads_ahead_only_what_is_not_resident() -> None:
    ids = traces()[0]
    lru = POLICIES.get("lru")
    plain = run_layer(lru, ids, 8, 32)
    # an oracle ranking: this token's own experts first
    ranked = np.concatenate([ids, np.zeros((ids.shape[0], 8), dtype=ids.dtype)], axis=1)
    run = run_layer(lru, ids, 8, 32, None, ranked, 4)
    assert np.array_equal(run.hits, plain.hits)  # the cache sees the same accesses
    assert run.covered is not None and run.issued is not None
    assert not np.any(run.covered & run.hits)  # only misses are covered
    # every miss but those on experts resident when the token began (then evicted by the
    # token's own earlier misses, as in the stack-distance stream) was read ahead
    assert run.covered.sum() >= 0.9 * (~run.hits).sum()
    assert (run.issued >= 0).sum() <= 4 * ids.shape[0]
