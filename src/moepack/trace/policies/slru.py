"""``slru``: segmented LRU. New experts enter a probation segment; a hit there promotes the
expert to a protected segment (80 % of the slots), whose oldest member is demoted back to
probation when it overflows. Evictions take probation's oldest: an expert used once cannot
push out one used repeatedly."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..cache_policy import CachePolicy, ExpertCache

ORDER = 30
PROTECTED_SHARE = 0.8


class SlruCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.protected_max = max(0, min(capacity - 1, int(capacity * PROTECTED_SHARE)))
        self.probation: OrderedDict[int, int] = OrderedDict()
        self.protected: OrderedDict[int, int] = OrderedDict()

    def __contains__(self, expert: object) -> bool:
        return expert in self.probation or expert in self.protected

    def access(self, expert: int) -> int:
        prot, prob = self.protected, self.probation
        if expert in prot:
            prot.move_to_end(expert)
            return -1
        if expert in prob:
            prot[expert] = prob.pop(expert)
            if len(prot) > self.protected_max:
                old, slot = prot.popitem(last=False)
                prob[old] = slot
            return -1
        if len(prob) + len(prot) >= self.capacity:
            seg = prob if prob else prot
            slot = seg.popitem(last=False)[1]
        else:
            slot = len(prob) + len(prot)
        prob[expert] = slot
        return slot


class Slru(CachePolicy):
    name = "slru"
    summary = "segmented LRU (probation, then 80 % protected)"

    def new_cache(
        self, capacity: int, n_expert: int, stream: np.ndarray, learned: object
    ) -> ExpertCache:
        return SlruCache(capacity)


PLUGIN = Slru()
