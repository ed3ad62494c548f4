"""A trace's access streams through a policy's caches: which lookups hit, where misses land,
and what a predictor's read-ahead covered.

Prefetching is modelled as a read-ahead buffer beside the cache: before a token reaches a
layer, the predictor's best-ranked experts that are not resident (up to the fetch budget)
are read into it; a miss on one of them
needs no read of its own (covered: the read was issued early, off the token's critical
path), the others are wasted reads. The cache itself sees the same accesses either way, so a
policy's hit rate does not depend on the predictor and the two are judged apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..trace.cache_policy import CachePolicy
from ..trace.stackdist import stack_distances


@dataclass
class LayerRun:
    """One layer's lookups: ``slots[t, s]`` -1 on a hit, else the slot the expert went to;
    with a prefetch, ``covered`` (misses the read-ahead had read) and ``issued`` (the experts
    read ahead, ``int32[tokens, budget]``, -1 where fewer were))."""

    slots: np.ndarray
    covered: np.ndarray | None = None
    issued: np.ndarray | None = None

    @property
    def hits(self) -> np.ndarray:
        return self.slots < 0


def _slot_type(capacity: int) -> type[np.signedinteger]:
    """The narrowest signed type for slots below ``capacity`` and -1 (a hit)."""
    return np.int16 if capacity < 1 << 15 else np.int32


def run_layer(
    policy: CachePolicy,
    ids: np.ndarray,
    capacity: int,
    n_expert: int,
    learned: object = None,
    ranked: np.ndarray | None = None,
    budget: int = 0,
) -> LayerRun:
    """Every access of ``ids[tokens, k]`` through a fresh cache of ``capacity`` slots; with
    ``ranked[tokens, m]`` (a predictor's experts, best first), the first ``budget`` of each
    token's that are not resident are read ahead."""
    stream = np.asarray(ids)
    cache = policy.new_cache(capacity, n_expert, stream, learned)
    access = cache.access
    rows = stream.tolist()
    out: list[int] = []
    push = out.append
    if ranked is None or budget <= 0:
        for row in rows:
            for e in row:
                push(access(e))
        return LayerRun(np.asarray(out, dtype=_slot_type(capacity)).reshape(stream.shape))
    issued = np.full((stream.shape[0], budget), -1, dtype=np.int32)
    covered: list[bool] = []
    for t, (row, guess) in enumerate(zip(rows, np.asarray(ranked).tolist(), strict=True)):
        ahead = []
        for e in guess:
            if e not in cache:
                ahead.append(e)
                if len(ahead) == budget:
                    break
        issued[t, : len(ahead)] = ahead
        for e in row:
            slot = access(e)
            push(slot)
            covered.append(slot >= 0 and e in ahead)
    return LayerRun(
        np.asarray(out, dtype=_slot_type(capacity)).reshape(stream.shape),
        np.asarray(covered, dtype=bool).reshape(stream.shape),
        issued,
    )


def layer_hits(
    policy: CachePolicy, ids: np.ndarray, capacity: int, n_expert: int, learned: object = None
) -> np.ndarray:
    """``[tokens, k]`` bool: which of one layer's lookups hit."""
    return run_layer(policy, ids, capacity, n_expert, learned).hits


def lru_hits_by_size(ids: np.ndarray, n_expert: int, sizes: list[int]) -> list[np.ndarray]:
    """LRU's hits at every size from one pass of exact stack distances (Mattson: an LRU of
    ``C`` slots hits exactly the accesses at distance below ``C``)."""
    d = stack_distances(np.asarray(ids), n_expert)
    return [(d >= 0) & (d < c) for c in sizes]


@dataclass(frozen=True)
class HitRates:
    """Hits over lookups, over all tokens and over decode tokens (None: the trace has none)."""

    lookups: int
    hits: int
    decode_lookups: int
    decode_hits: int

    @property
    def lifetime(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def decode(self) -> float | None:
        return self.decode_hits / self.decode_lookups if self.decode_lookups else None

    @staticmethod
    def of(hits: np.ndarray, decode_mask: np.ndarray) -> HitRates:
        """From ``hits[tokens, ...]`` and which tokens decode."""
        per_token = hits.reshape(hits.shape[0], -1)
        dec = per_token[decode_mask]
        return HitRates(int(per_token.size), int(per_token.sum()), int(dec.size), int(dec.sum()))

    def __add__(self, other: HitRates) -> HitRates:
        return HitRates(
            self.lookups + other.lookups,
            self.hits + other.hits,
            self.decode_lookups + other.decode_lookups,
            self.decode_hits + other.decode_hits,
        )

    def to_json(self) -> dict[str, Any]:
        return {"lifetime": self.lifetime, "decode": self.decode, "lookups": self.lookups}
