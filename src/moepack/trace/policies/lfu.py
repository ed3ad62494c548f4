"""``lfu``: evict the resident expert accessed least often so far (counts kept for every
expert of the layer, evicted ones included; ties go to the least recently used)."""

from __future__ import annotations

import heapq

import numpy as np

from ..cache_policy import CachePolicy, ExpertCache, SlotCache

ORDER = 20


class LfuCache(SlotCache):
    def __init__(self, capacity: int, n_expert: int) -> None:
        super().__init__(capacity)
        self.count = [0] * n_expert
        self.stamp = [0] * n_expert
        self.heap: list[tuple[int, int, int]] = []  # (count, stamp, expert), stale ones skipped
        self.tick = 0

    def _victim(self) -> int:
        heap, slot_of = self.heap, self.slot_of
        while True:
            c, s, e = heapq.heappop(heap)
            if e in slot_of and self.count[e] == c and self.stamp[e] == s:
                return e

    def access(self, expert: int) -> int:
        self.tick += 1
        self.count[expert] += 1
        self.stamp[expert] = self.tick
        hit = expert in self.slot_of
        if hit:
            slot = -1
        else:
            victim = self._victim() if len(self.slot_of) >= self.capacity else None
            slot = self.take_slot(victim)
            self.slot_of[expert] = slot
        heapq.heappush(self.heap, (self.count[expert], self.tick, expert))
        if len(self.heap) > 8 * self.capacity + 64:  # drop stale entries now and then
            self.heap = [(self.count[e], self.stamp[e], e) for e in self.slot_of]
            heapq.heapify(self.heap)
        return slot


class Lfu(CachePolicy):
    name = "lfu"
    summary = "least frequently used (history counts, LRU among ties)"

    def new_cache(
        self, capacity: int, n_expert: int, stream: np.ndarray, learned: object
    ) -> ExpertCache:
        return LfuCache(capacity, n_expert)


PLUGIN = Lfu()
