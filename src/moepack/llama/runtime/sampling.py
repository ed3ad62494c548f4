"""Choosing the next token from logits: greedy, or temperature + top-p with a seeded RNG.

Done in numpy rather than by llama.cpp's sampler chain so that a capture is reproducible from
its recorded settings alone (seed, temperature, top-p) and costs nothing per token compared
with a forward pass.
"""

from __future__ import annotations

import numpy as np


class Sampler:
    """``temp == 0`` is greedy (argmax; ties to the lowest id); otherwise softmax(logits/temp)
    restricted to the smallest set of tokens whose probability reaches ``top_p``."""

    def __init__(self, temp: float = 0.0, top_p: float = 1.0, seed: int = 0) -> None:
        self.temp = float(temp)
        self.top_p = float(top_p)
        self.rng = np.random.default_rng(seed)

    def sample(self, logits: np.ndarray) -> int:
        x = np.asarray(logits, dtype=np.float64)
        if self.temp <= 0.0:
            return int(np.argmax(x))
        x = (x - x.max()) / self.temp
        p = np.exp(x)
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        if self.top_p < 1.0:
            cum = np.cumsum(p[order])
            keep = int(np.searchsorted(cum, self.top_p) + 1)
            order = order[:keep]
        q = p[order] / p[order].sum()
        return int(order[self.rng.choice(len(order), p=q)])
