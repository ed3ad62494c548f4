"""``lru``: evict the least recently used expert (what most streaming runtimes ship)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..cache_policy import CachePolicy, ExpertCache

ORDER = 10


class LruCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: OrderedDict[int, int] = OrderedDict()  # expert -> slot, oldest first

    def __contains__(self, expert: object) -> bool:
        return expert in self.order

    def access(self, expert: int) -> int:
        order = self.order
        if expert in order:
            order.move_to_end(expert)
            return -1
        slot = order.popitem(last=False)[1] if len(order) >= self.capacity else len(order)
        order[expert] = slot
        return slot


class Lru(CachePolicy):
    name = "lru"
    summary = "least recently used"

    def new_cache(
        self, capacity: int, n_expert: int, stream: np.ndarray, learned: object
    ) -> ExpertCache:
        return LruCache(capacity)


PLUGIN = Lru()
