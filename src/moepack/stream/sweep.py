"""Hit rate and the fetch-limited tokens/s against cache size, for each policy.

Hit rates are simulated on the trace (no reads: LRU at every size from one pass of exact
stack distances, the others through their caches at each size); tokens/s is the bandwidth a replay measured divided by the bytes each
size leaves to read per token, so every point rests on one measured read rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..progress import NULL_PROGRESS, ProgressSink
from ..trace.cache_policy import POLICIES
from ..trace.core import RoutingTrace
from .simulate import HitRates, layer_hits, lru_hits_by_size


@dataclass(frozen=True)
class SweepPoint:
    policy: str
    slots: int  # per layer
    cache_bytes: int
    rates: HitRates
    bytes_per_token: float
    tokens_per_second: float | None

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "slots_per_layer": self.slots,
            "cache_bytes": self.cache_bytes,
            "hit_rate": self.rates.to_json(),
            "bytes_per_token": self.bytes_per_token,
            "fetch_limited_tokens_per_s": self.tokens_per_second,
        }


def default_sizes(k: int, n_expert: int, points: int = 8) -> list[int]:
    """Slots per layer from top-k up to every expert, spaced evenly in log."""
    grid = np.geomspace(k, n_expert, points)
    return sorted({int(round(x)) for x in grid} | {k, n_expert})


def sweep(
    trace: RoutingTrace,
    expert_bytes: list[int],
    policies: list[str],
    sizes: list[int],
    bandwidth: float | None,
    rows: tuple[int, int] | None = None,
    progress: ProgressSink = NULL_PROGRESS,
    fit_rows: np.ndarray | None = None,
) -> list[SweepPoint]:
    """Every policy at every size (slots per layer, each at least top-k) over the tokens
    ``rows``; pinned sets learned from ``fit_rows`` (default: the same tokens)."""
    lo, hi = rows or (0, trace.tokens)
    ids = np.asarray(trace.ids[lo:hi])
    train = np.asarray(trace.ids[fit_rows]) if fit_rows is not None else ids
    decode = trace.phase_mask("decode")[lo:hi]
    tokens = ids.shape[0]
    out = []
    progress.start("sweeping", len(policies) * trace.layers, unit="layers")
    for name in policies:
        policy = POLICIES.get(name)
        totals = [HitRates(0, 0, 0, 0) for _ in sizes]
        missed = [0.0 for _ in sizes]
        for layer in range(trace.layers):
            layer_ids = ids[:, layer, :]
            if policy.name == "lru":  # every size from one pass of stack distances
                per_size = lru_hits_by_size(layer_ids, trace.n_expert, sizes)
            else:
                per_size = [
                    layer_hits(
                        policy,
                        layer_ids,
                        c,
                        trace.n_expert,
                        policy.fit(train[:, layer, :], trace.n_expert, c),
                    )
                    for c in sizes
                ]
            for i, h in enumerate(per_size):
                totals[i] = totals[i] + HitRates.of(h, decode)
                missed[i] += float((~h).sum()) * expert_bytes[layer]
            progress.advance(1)
        for size, total, m in zip(sizes, totals, missed, strict=True):
            per_token = m / tokens
            out.append(
                SweepPoint(
                    policy.name,
                    size,
                    size * sum(expert_bytes),
                    total,
                    per_token,
                    bandwidth / per_token if bandwidth and per_token > 0 else None,
                )
            )
    progress.finish()
    return out
