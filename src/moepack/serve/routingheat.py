"""The routing of the last tokens, per MoE layer and expert: the dashboard's heat map.

Fed by the hook's ``on_route`` (each layer's top-k ``[tokens, k]`` as llama.cpp computes it)
into one ring of the last ``window`` tokens per layer, so what it shows is recent and its
memory fixed; read as counts per (layer, expert) when the page asks. Called inside
llama.cpp's compute and read from the server's threads, hence the lock (held for a copy).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

WINDOW = 256
"""Tokens per layer the map counts (the most recent)."""


class RoutingHeat:
    """A ring of each layer's last ``window`` tokens' chosen experts."""

    def __init__(self, blocks: list[int], k: int, n_expert: int, window: int = WINDOW) -> None:
        self.blocks = list(blocks)
        self.index = {b: i for i, b in enumerate(self.blocks)}
        self.k = k
        self.n_expert = n_expert
        self.window = window
        self.ring = np.full((len(self.blocks), window, k), -1, dtype=np.int32)
        self.next = np.zeros(len(self.blocks), dtype=np.int64)  # tokens seen per layer
        self._lock = threading.Lock()

    def on_route(self, block: int, ids: np.ndarray) -> None:
        """A layer's choice for a pass (any number of tokens; the last ``window`` kept)."""
        i = self.index.get(block)
        if i is None:
            return
        rows = np.asarray(ids).reshape(-1, self.k)[-self.window :]
        n = rows.shape[0]
        with self._lock:
            at = int(self.next[i] % self.window)
            first = min(n, self.window - at)
            self.ring[i, at : at + first] = rows[:first]
            if first < n:
                self.ring[i, : n - first] = rows[first:]
            self.next[i] += n

    def counts(self) -> np.ndarray:
        """``[layers, n_expert]``: how often each expert was chosen in the layer's window."""
        with self._lock:
            ring = self.ring.copy()
        out = np.zeros((len(self.blocks), self.n_expert), dtype=np.int64)
        for i in range(len(self.blocks)):
            ids = ring[i].reshape(-1)
            ids = ids[(ids >= 0) & (ids < self.n_expert)]
            out[i] = np.bincount(ids, minlength=self.n_expert)
        return out

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            seen = int(self.next.max()) if len(self.blocks) else 0
        return {
            "layers": self.blocks,
            "n_expert": self.n_expert,
            "top_k": self.k,
            "window": self.window,
            "tokens_seen": seen,
            "counts": self.counts().tolist(),
        }
