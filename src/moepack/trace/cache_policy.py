"""The cache-policy interface and its registry.

A policy decides which experts of one MoE layer stay resident in that layer's expert cache of
``capacity`` slots. The workload is the layer's access stream: every token's routed experts in
router order, token after token (``ids[t, layer, 0..k-1]``), each access a lookup that either
hits or loads the expert into a slot, evicting the policy's victim when the cache is full.
This is the stream ``trace stats`` computes exact LRU stack distances over, so the two agree.
One consequence: a token's own earlier misses may evict another of its experts before it is
looked up (with LRU only when that expert was the least recent), which a runtime that loads
a token's experts together would avoid; hit rates are the stack-distance model's.

A policy's ``new_cache`` returns an ``ExpertCache``: ``access(e)`` returns -1 on a hit, else
the slot the expert was loaded into (a victim's slot is reused), so a replay knows where the
read bytes go. ``fit`` learns what a policy may learn from training tokens (a hot set).
Adding a policy is adding one module under ``policies/`` whose ``PLUGIN`` or ``PLUGINS`` is a
``CachePolicy`` (``moepack.registry``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Protocol

import numpy as np

from ..registry import Registry


class ExpertCache(Protocol):
    """One layer's resident experts under a policy."""

    def __contains__(self, expert: object) -> bool: ...

    def access(self, expert: int) -> int:
        """Look ``expert`` up: -1 when resident (a hit), else the slot it was loaded into."""
        ...


class CachePolicy(ABC):
    """A cache policy: a name users type and a factory of per-layer caches."""

    name: str
    summary: str
    aliases: ClassVar[tuple[str, ...]] = ()
    learns: ClassVar[bool] = False  # fit() learns from training tokens

    def fit(self, train: np.ndarray, n_expert: int, capacity: int) -> object:
        """What this policy learns from one layer's training tokens ``[tokens, k]``."""
        return None

    @abstractmethod
    def new_cache(
        self, capacity: int, n_expert: int, stream: np.ndarray, learned: object
    ) -> ExpertCache:
        """An empty cache of ``capacity`` slots for a layer whose accesses will be ``stream``
        (``[tokens, k]``; only an offline policy such as Belady's may look at it)."""


class SlotCache:
    """Slot bookkeeping shared by the caches: free slots first, then a victim's slot."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.slot_of: dict[int, int] = {}

    def __contains__(self, expert: object) -> bool:
        return expert in self.slot_of

    def take_slot(self, victim: int | None) -> int:
        """The slot for a new expert: a free one, or ``victim``'s (which leaves)."""
        if victim is None:
            return len(self.slot_of)
        return self.slot_of.pop(victim)


POLICIES: Registry[CachePolicy] = Registry(
    "cache policy", f"{__package__}.policies", base=CachePolicy, every_module=True
)
"""Every cache policy: lru, lfu, slru, pinned hot sets + LRU, belady (the offline optimum)."""
