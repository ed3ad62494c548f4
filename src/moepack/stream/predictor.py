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
from ..trace.pairs import PairCounts

TIE_BREAK = 1e-3


@dataclass(frozen=True)
class Context:
    """What a predictor sees for one layer: the evaluated tokens' ids ``[tokens, layers, k]``
    (it may use the row before each token and the layers before ``layer`` of the same row:
    long traces are scored in windows, each given the token before it), which rows start a
    prompt (no earlier token there), and the training frequencies."""

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


DENSE_EXPERTS = 1024
"""Up to this many experts a transition table is a dense ``[n, n]`` float32 (4 MiB at most);
beyond, only the transitions the training tokens hold are kept (``Transitions``): a table
sized by a header's expert count would be 16 GiB for 65,536 experts, whatever the trace."""
ROW_CELLS = 1 << 20
"""Scores are made for at most this many (token, expert) cells at a time (4 MiB of float32)."""


@dataclass(frozen=True)
class Transitions:
    """Row-normalised transition weights ``i -> j``: a dense table for small expert counts, or
    the non-zero cells by row (CSR) beyond ``DENSE_EXPERTS``."""

    n_expert: int
    dense: np.ndarray | None  # float32[n, n], or None
    indptr: np.ndarray  # int64[n + 1]: row i's cells are cols[indptr[i]:indptr[i + 1]]
    cols: np.ndarray  # int64
    weights: np.ndarray  # float32

    def scores(self, prev: np.ndarray) -> np.ndarray:
        """``float32[tokens, n_expert]``: the sum of the rows of each token's ``prev`` experts
        (``[tokens, k]``), in bounded slices of tokens."""
        prev = np.asarray(prev, dtype=np.int64)
        n = self.n_expert
        out = np.empty((prev.shape[0], n), dtype=np.float32)
        step = max(1, ROW_CELLS // (n * max(1, prev.shape[1])))
        for a in range(0, prev.shape[0], step):
            rows = prev[a : a + step]
            if self.dense is not None:
                out[a : a + step] = self.dense[rows].sum(axis=1)
                continue
            starts, stops = self.indptr[rows.ravel()], self.indptr[rows.ravel() + 1]
            lengths = stops - starts
            token = np.repeat(np.arange(rows.size, dtype=np.int64) // rows.shape[1], lengths)
            first = np.cumsum(lengths) - lengths  # where each row's cells begin in the gather
            cell = np.repeat(starts - first, lengths) + np.arange(int(lengths.sum()))
            flat = np.bincount(
                token * n + self.cols[cell], weights=self.weights[cell], minlength=len(rows) * n
            )
            out[a : a + step] = flat.reshape(len(rows), n)
        return out


def transition_counts(src: np.ndarray, dst: np.ndarray, n_expert: int) -> Transitions:
    """How often expert ``j`` is in ``dst[t]`` when expert ``i`` is in ``src[t]`` (rows of
    both ``[tokens, k]``), row-normalised; memory follows the tokens beyond ``DENSE_EXPERTS``."""
    counts = PairCounts.of(
        np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64), n_expert, DENSE_EXPERTS
    )
    total = np.bincount(counts.i, weights=counts.count, minlength=n_expert)
    weights = counts.count.astype(np.float32) / total[counts.i].astype(np.float32)
    indptr = np.zeros(n_expert + 1, dtype=np.int64)
    np.cumsum(np.bincount(counts.i, minlength=n_expert), out=indptr[1:])
    dense: np.ndarray | None = None
    if n_expert <= DENSE_EXPERTS:
        flat = np.zeros(n_expert * n_expert, dtype=np.float32)
        flat[counts.code] = weights
        dense = flat.reshape(n_expert, n_expert)
    return Transitions(n_expert, dense, indptr, counts.j, weights)


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
