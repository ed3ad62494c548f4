"""``pinned-N``: the N % most used experts of the training tokens pinned (loaded on first use,
never evicted), the other slots an LRU — colibri's learned hot set. Three shares are offered,
so a sweep shows whether pinning beats plain LRU at any share."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..cache_policy import CachePolicy, ExpertCache

ORDER = 40


class PinnedCache:
    def __init__(self, capacity: int, pinned: frozenset[int]) -> None:
        self.pinned = pinned
        self.pinned_slot: dict[int, int] = {}
        self.lru_capacity = capacity - len(pinned)
        self.order: OrderedDict[int, int] = OrderedDict()
        self.next_free = 0

    def __contains__(self, expert: object) -> bool:
        return expert in self.pinned_slot or expert in self.order

    def access(self, expert: int) -> int:
        if expert in self.pinned:
            if expert in self.pinned_slot:
                return -1
            slot = self.next_free
            self.next_free += 1
            self.pinned_slot[expert] = slot
            return slot
        order = self.order
        if expert in order:
            order.move_to_end(expert)
            return -1
        if len(order) >= self.lru_capacity:
            slot = order.popitem(last=False)[1]
        else:
            slot = self.next_free
            self.next_free += 1
        order[expert] = slot
        return slot


class Pinned(CachePolicy):
    learns = True

    def __init__(self, share: float) -> None:
        self.share = share
        self.name = f"pinned-{round(share * 100)}"
        self.summary = (
            f"{round(share * 100)} % of the slots pinned to the hottest experts, LRU rest"
        )

    def fit(self, train: np.ndarray, n_expert: int, capacity: int) -> object:
        counts = np.bincount(np.asarray(train, dtype=np.int64).ravel(), minlength=n_expert)
        # leave at least one LRU slot per routed expert so a token never evicts its own
        n = min(int(capacity * self.share), capacity - train.shape[1], n_expert)
        if n <= 0:
            return frozenset()
        hot = np.argsort(-counts, kind="stable")[:n]
        return frozenset(int(e) for e in hot)

    def new_cache(
        self, capacity: int, n_expert: int, stream: np.ndarray, learned: object
    ) -> ExpertCache:
        pinned = learned if isinstance(learned, frozenset) else frozenset()
        return PinnedCache(capacity, pinned)


PLUGINS = [Pinned(0.25), Pinned(0.5), Pinned(0.75)]
