"""Two statistics of expert order under a trace: how many contiguous runs a token's experts
make in a given slot order, and the greedy co-activation chain that keeps experts chosen
together adjacent. The planner scores and builds orders with them; ``trace stats`` orders its
lift heatmap by the chain, so the clusters show on the diagonal."""

from __future__ import annotations

import numpy as np


def runs_per_token(ids: np.ndarray, slot_of: np.ndarray) -> float:
    """Mean number of contiguous slot runs per token (``ids[tokens, k]``, ``slot_of[expert]``)."""
    if ids.size == 0:
        return 0.0
    slots = np.sort(slot_of[ids.astype(np.int64)], axis=1)
    gaps = np.count_nonzero(np.diff(slots, axis=1) > 1, axis=1)
    return float(np.mean(1 + gaps))


def greedy_chain(coact: np.ndarray, counts: np.ndarray, window: int) -> np.ndarray:
    """``perm[slot] = expert``: a chain that keeps strongly co-activated experts adjacent."""
    n = len(counts)
    placed = np.zeros(n, dtype=bool)
    order = [int(np.argmax(counts))]
    placed[order[0]] = True
    score = coact[order[0]].astype(np.float64)
    recent = [order[0]]
    for _ in range(n - 1):
        cand = np.where(placed, -np.inf, score + 1e-9 * counts)
        nxt = int(np.argmax(cand))
        order.append(nxt)
        placed[nxt] = True
        recent.append(nxt)
        score = score + coact[nxt]
        if len(recent) > window:
            score = score - coact[recent.pop(0)]
    return np.asarray(order, dtype=np.int64)
