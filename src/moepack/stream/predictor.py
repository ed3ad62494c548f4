"""The predictor interface and its registry: which experts the next token will route to.

A predictor scores every expert of one layer for every token from what a runtime knows
before that token reaches the layer: earlier tokens (all layers) and the same token's earlier
layers. ``fit`` learns from training tokens only (whole prompts held out are scored, never
fitted on). ``scores`` returns ``float32[tokens, n_expert]``; the fetch budget's top scores are
the prediction. Every score is tie-broken by the training frequency, so a predictor with
nothing to say (a prompt's first token) falls back to the hot list.

Combinations are named with ``+`` (``sticky+markov``): the parts' scores, each scaled to a
row maximum of 1, are added. Adding a predictor is adding one module under ``predictors/``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..errors import BadInput
from ..registry import Registry

TIE_BREAK = 1e-3


@dataclass(frozen=True)
class Context:
    """What a predictor sees for one layer: the evaluated tokens' ids ``[tokens, layers, k]``
    (it may use the rows before each token and the layers before ``layer`` of the same row),
    which rows start a prompt (no earlier token there), and the training frequencies."""

    ids: np.ndarray
    layer: int
    starts: np.ndarray  # bool[tokens]
    frequency: np.ndarray  # float64[n_expert], this layer's training share

    @property
    def n_expert(self) -> int:
        return int(self.frequency.size)


class Predictor(ABC):
    """A predictor: a name users type, what it learns, and its scores."""

    name: str
    summary: str
    aliases: ClassVar[tuple[str, ...]] = ()

    def fit(self, train: np.ndarray, n_expert: int, layer: int) -> object:
        """What this predictor learns from the training tokens ``[tokens, layers, k]``."""
        return None

    @abstractmethod
    def scores(self, ctx: Context, learned: object) -> np.ndarray:
        """``float32[tokens, n_expert]``: higher is likelier (the tie-break is added later)."""


PREDICTORS: Registry[Predictor] = Registry(
    "predictor", f"{__package__}.predictors", base=Predictor, every_module=True
)
"""Every predictor: frequency, sticky (previous token), markov, cross-layer (previous layer)."""


def onehot(ids: np.ndarray, n_expert: int, weight: float = 1.0) -> np.ndarray:
    """``[tokens, k] -> float32[tokens, n_expert]``: ``weight`` where an expert is chosen."""
    out = np.zeros((ids.shape[0], n_expert), dtype=np.float32)
    np.put_along_axis(out, np.asarray(ids, dtype=np.int64), weight, axis=1)
    return out


def previous_rows(ids: np.ndarray) -> np.ndarray:
    """The row before each row (row 0 for itself); callers mask prompt starts."""
    prev = np.empty_like(ids)
    prev[1:] = ids[:-1]
    prev[:1] = ids[:1]
    return prev


def transition_counts(src: np.ndarray, dst: np.ndarray, n_expert: int) -> np.ndarray:
    """``[n_expert, n_expert]`` float32: how often expert ``j`` is in ``dst[t]`` when expert
    ``i`` is in ``src[t]`` (rows of both ``[tokens, k]``), row-normalised."""
    k1, k2 = src.shape[1], dst.shape[1]
    a = np.repeat(np.asarray(src, dtype=np.int64), k2, axis=1).ravel()
    b = np.tile(np.asarray(dst, dtype=np.int64), (1, k1)).ravel()
    m = np.bincount(a * n_expert + b, minlength=n_expert * n_expert).astype(np.float32)
    m = m.reshape(n_expert, n_expert)
    total = m.sum(axis=1, keepdims=True)
    return np.divide(m, total, out=np.zeros_like(m), where=total > 0)


def transition_scores(matrix: np.ndarray, prev: np.ndarray, rows: int = 4096) -> np.ndarray:
    """``float32[tokens, n_expert]``: the sum of ``matrix``'s rows for each token's ``prev``
    experts (``[tokens, k]``), ``rows`` tokens at a time to bound the temporary."""
    prev = np.asarray(prev, dtype=np.int64)
    out = np.empty((prev.shape[0], matrix.shape[1]), dtype=np.float32)
    for a in range(0, prev.shape[0], rows):
        out[a : a + rows] = matrix[prev[a : a + rows]].sum(axis=1)
    return out


def resolve(name: str) -> list[Predictor]:
    """The predictors of ``name`` (one, or several joined by ``+``)."""
    parts = [p.strip() for p in name.split("+")]
    if not parts or any(not p for p in parts):
        raise BadInput(f"predictor name {name!r} has an empty part")
    return [PREDICTORS.get(p) for p in parts]


def combined_scores(parts: list[Predictor], ctx: Context, learned: list[object]) -> np.ndarray:
    """The parts' scores, each scaled to a row maximum of 1, summed, plus the tie-break."""
    total = np.zeros((ctx.ids.shape[0], ctx.n_expert), dtype=np.float32)
    for p, state in zip(parts, learned, strict=True):
        s = p.scores(ctx, state)
        top = s.max(axis=1, keepdims=True)
        total += np.divide(s, top, out=np.zeros_like(s), where=top > 0)
    freq = ctx.frequency / max(float(ctx.frequency.max()), 1e-12)
    total += (TIE_BREAK * freq).astype(np.float32)[None, :]
    return total


def top_experts(scores: np.ndarray, budget: int) -> np.ndarray:
    """``[tokens, budget]`` int64: the ``budget`` best-scored experts of each row, best first."""
    budget = min(budget, scores.shape[1])
    part = np.argpartition(-scores, budget - 1, axis=1)[:, :budget]
    order = np.argsort(-np.take_along_axis(scores, part, axis=1), axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1)
