"""``belady``: evict the resident expert whose next use is furthest away (Belady's MIN). It
reads the future, so no runtime can run it; it is the upper bound no policy may beat on the
same access stream, and the gap to it is what a better policy could still win."""

from __future__ import annotations

import heapq

import numpy as np

from ..cache_policy import CachePolicy, ExpertCache, SlotCache

ORDER = 90
NEVER = 1 << 62


def next_use(stream: np.ndarray) -> np.ndarray:
    """``[accesses]``: the position of each access's expert's next access (``NEVER``)."""
    flat = np.asarray(stream, dtype=np.int64).ravel()
    order = np.argsort(flat, kind="stable")
    out = np.full(flat.size, NEVER, dtype=np.int64)
    same = flat[order[1:]] == flat[order[:-1]]
    out[order[:-1][same]] = order[1:][same]
    return out


class BeladyCache(SlotCache):
    def __init__(self, capacity: int, stream: np.ndarray) -> None:
        super().__init__(capacity)
        self.future = next_use(stream).tolist()
        self.pos = 0
        self.when: dict[int, int] = {}
        self.heap: list[tuple[int, int]] = []  # (-next use, expert), stale ones skipped

    def access(self, expert: int) -> int:
        nxt = self.future[self.pos]
        self.pos += 1
        if expert in self.slot_of:
            slot = -1
        else:
            victim = None
            if len(self.slot_of) >= self.capacity:
                heap, when = self.heap, self.when
                while True:
                    neg, e = heapq.heappop(heap)
                    if e in self.slot_of and when[e] == -neg:
                        victim = e
                        break
            slot = self.take_slot(victim)
            self.slot_of[expert] = slot
        self.when[expert] = nxt
        heapq.heappush(self.heap, (-nxt, expert))
        if len(self.heap) > 8 * self.capacity + 64:  # drop stale entries now and then
            self.heap = [(-self.when[e], e) for e in self.slot_of]
            heapq.heapify(self.heap)
        return slot


class Belady(CachePolicy):
    name = "belady"
    summary = "Belady's optimum (reads the future: the upper bound)"
    aliases = ("opt", "min")

    def new_cache(
        self, capacity: int, n_expert: int, stream: np.ndarray, learned: object
    ) -> ExpertCache:
        return BeladyCache(capacity, stream)


PLUGIN = Belady()
