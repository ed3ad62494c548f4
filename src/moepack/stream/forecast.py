"""Predictors fitted and judged: recall and precision at a fetch budget on held-out tokens,
and the read-ahead sets a replay prefetches.

Recall is the share of a token's routed experts the prediction held; precision the share of
the predicted experts that were routed (a budget of ``b`` experts per token and layer, of
which ``k`` route). Held out are whole prompts (the last quarter of them, at least one) when
the trace records several, else the last quarter of its tokens, and the result says which.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..binding import shape_only_warnings
from ..errors import BadInput
from ..trace.core import RoutingTrace
from .predictor import (
    PREDICTORS,
    ROW_CELLS,
    Context,
    Predictor,
    combined_scores,
    resolve,
    top_experts,
)


@dataclass(frozen=True)
class Fitted:
    """One (possibly combined) predictor fitted per layer on training tokens."""

    name: str
    parts: list[Predictor]
    learned: list[list[object]]  # [layer][part]
    frequency: list[np.ndarray]  # [layer] float64[n_expert]

    def rank_layer(self, ids: np.ndarray, starts: np.ndarray, layer: int, depth: int) -> np.ndarray:
        """``int16[tokens, depth]``: one layer's best-scored ``depth`` experts, best first."""
        depth = min(depth, int(self.frequency[layer].size))
        out = np.empty((ids.shape[0], depth), dtype=np.int16)
        for rows, scores in self._windows(ids, starts, layer):
            out[rows] = top_experts(scores, depth)
        return out

    def predict(self, ids: np.ndarray, starts: np.ndarray, budget: int) -> np.ndarray:
        """``int16[tokens, layers, budget]``: each token's predicted experts per layer."""
        tokens, layers, _k = ids.shape
        n_expert = int(self.frequency[0].size)
        out = np.empty((tokens, layers, min(budget, n_expert)), dtype=np.int16)
        for layer in range(layers):
            out[:, layer, :] = self.rank_layer(ids, starts, layer, budget)
        return out

    def _windows(
        self, ids: np.ndarray, starts: np.ndarray, layer: int
    ) -> Iterator[tuple[slice, np.ndarray]]:
        """One layer's scores, ``ROW_CELLS`` (token, expert) cells at a time: each window is
        scored with the token before it, which is all a predictor looks back at, so memory
        follows the window and not ``tokens × n_expert``."""
        n_expert = int(self.frequency[layer].size)
        step = max(1, ROW_CELLS // n_expert)
        for a in range(0, ids.shape[0], step):
            b = min(a + step, ids.shape[0])
            lo = max(0, a - 1)
            ctx = Context(ids[lo:b], layer, starts[lo:b], self.frequency[layer])
            yield slice(a, b), combined_scores(self.parts, ctx, self.learned[layer])[a - lo :]


def fit(name: str, train: np.ndarray, n_expert: int) -> Fitted:
    """Fit the predictor ``name`` on ``train[tokens, layers, k]``."""
    parts = resolve(name)
    if train.shape[0] < 2:
        raise BadInput(f"predictor {name!r} needs at least 2 training tokens")
    learned = [[p.fit(train, n_expert, layer) for p in parts] for layer in range(train.shape[1])]
    freq = []
    for layer in range(train.shape[1]):
        c = np.bincount(np.asarray(train[:, layer, :], dtype=np.int64).ravel(), minlength=n_expert)
        freq.append(c / max(1, c.sum()))
    return Fitted(name, parts, learned, freq)


def prompt_starts(trace: RoutingTrace, rows: np.ndarray) -> np.ndarray:
    """``bool[len(rows)]``: which of ``rows`` begin a prompt, or follow a gap in ``rows``."""
    first = np.zeros(trace.tokens, dtype=bool)
    for s in trace.prompt_segments:
        if s.stop > s.start:
            first[s.start] = True
    out = first[rows]
    out[0] = True
    out[1:] |= np.diff(rows) != 1
    return out


@dataclass(frozen=True)
class Holdout:
    train_rows: np.ndarray
    eval_rows: np.ndarray
    by_prompts: bool
    train_prompts: int
    eval_prompts: int

    def to_json(self) -> dict[str, Any]:
        return {
            "by_prompts": self.by_prompts,
            "train_tokens": int(self.train_rows.size),
            "held_out_tokens": int(self.eval_rows.size),
            "train_prompts": self.train_prompts,
            "held_out_prompts": self.eval_prompts,
        }


def holdout(trace: RoutingTrace) -> Holdout:
    """The last quarter of the prompts held out (whole prompts), else the last quarter of the
    tokens of a one-prompt trace."""
    n = trace.prompts
    if n >= 2:
        held = max(1, n // 4)
        rows = trace.prompt_split(list(range(n - held, n)))
        return Holdout(rows.train_rows, rows.held_out_rows, True, n - held, held)
    if trace.tokens < 8:
        raise BadInput(f"{trace.tokens} tokens are too few to hold any out", trace.path)
    cut = trace.tokens - trace.tokens // 4
    return Holdout(np.arange(cut), np.arange(cut, trace.tokens), False, 1, 0)


@dataclass(frozen=True)
class PredictorScore:
    predictor: str
    budget: int
    recall: float
    precision: float
    decode_recall: float | None
    decode_precision: float | None

    def to_json(self) -> dict[str, Any]:
        return {
            "predictor": self.predictor,
            "budget": self.budget,
            "recall": self.recall,
            "precision": self.precision,
            "decode_recall": self.decode_recall,
            "decode_precision": self.decode_precision,
        }


@dataclass
class PredictResult:
    trace: str
    k: int
    split: Holdout
    scores: list[PredictorScore]
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # bound to the model by shape only

    def score(self, predictor: str, budget: int) -> PredictorScore:
        return next(s for s in self.scores if s.predictor == predictor and s.budget == budget)

    def to_json(self) -> dict[str, Any]:
        return {
            "trace": self.trace,
            "k": self.k,
            "split": self.split.to_json(),
            "scores": [s.to_json() for s in self.scores],
            "notes": list(self.notes),
            "warnings": list(self.warnings),
        }


def overlap(predicted: np.ndarray, ids: np.ndarray, n_expert: int) -> np.ndarray:
    """``int64[tokens]``: routed experts the prediction held, summed over layers (a mask of
    ``ROW_CELLS`` cells at a time)."""
    tokens, layers, _ = ids.shape
    got = np.zeros(tokens, dtype=np.int64)
    step = max(1, ROW_CELLS // n_expert)
    for a in range(0, tokens, step):
        b = min(a + step, tokens)
        for layer in range(layers):
            mask = np.zeros((b - a, n_expert), dtype=bool)
            np.put_along_axis(mask, predicted[a:b, layer, :].astype(np.int64), True, axis=1)
            held = np.take_along_axis(mask, ids[a:b, layer, :].astype(np.int64), axis=1)
            got[a:b] += held.sum(axis=1)
    return got


def evaluate(trace: RoutingTrace, predictors: list[str], budgets: list[int]) -> PredictResult:
    """Every predictor at every budget (experts per token and layer) on held-out tokens."""
    if not predictors or not budgets:
        raise BadInput("name at least one predictor and one fetch budget")
    bad = [b for b in budgets if b < 1]
    if bad:
        raise BadInput(f"a fetch budget is at least 1 expert, got {bad[0]}")
    split = holdout(trace)
    train = np.asarray(trace.ids[split.train_rows])
    ids = np.asarray(trace.ids[split.eval_rows])
    starts = prompt_starts(trace, split.eval_rows)
    decode = trace.phase_mask("decode")[split.eval_rows]
    tokens, layers, k = ids.shape
    scores = []
    for name in predictors:
        fitted = fit(name, train, trace.n_expert)
        for b in budgets:
            pred = fitted.predict(ids, starts, b)
            got = overlap(pred, ids, trace.n_expert)
            width = pred.shape[2]
            d = got[decode]
            scores.append(
                PredictorScore(
                    name,
                    b,
                    float(got.sum() / (tokens * layers * k)),
                    float(got.sum() / (tokens * layers * width)),
                    float(d.sum() / (d.size * layers * k)) if d.size else None,
                    float(d.sum() / (d.size * layers * width)) if d.size else None,
                )
            )
    notes = []
    if not split.by_prompts:
        notes.append("the trace records one prompt: its last quarter of tokens is held out")
    return PredictResult(trace.label(), k, split, scores, notes)


def default_predictors() -> list[str]:
    """What ``predict`` scores unless told: every predictor and two combinations."""
    return [*PREDICTORS.names(), "sticky+markov", "sticky+cross-layer"]


def predict(
    trace_path: str | os.PathLike[str],
    predictors: list[str] | None = None,
    budgets: list[int] | None = None,
    *,
    model_path: str | os.PathLike[str] | None = None,
    n_expert: int | None = None,
) -> PredictResult:
    """``evaluate`` on the trace file at ``trace_path``, checked against ``model_path`` when
    given (a trace that records no fingerprint says it was bound by shape only), with
    ``default_predictors()`` and budgets of k and 2k experts unless told."""
    from ..trace.formats import load_trace

    warnings: list[str] = []
    if model_path is not None:
        from ..checkpoint.model import MoeModel

        with MoeModel(model_path) as model:
            trace = load_trace(trace_path, n_expert=n_expert, model=model)
            warnings = shape_only_warnings("trace", trace.model_fingerprint, trace_path, model.path)
    else:
        trace = load_trace(trace_path, n_expert=n_expert)
    result = evaluate(trace, predictors or default_predictors(), budgets or [trace.k, 2 * trace.k])
    result.warnings = warnings
    return result
