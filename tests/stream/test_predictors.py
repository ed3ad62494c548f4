"""Predictors of the next token's experts, scored on held-out prompts."""

from __future__ import annotations

import numpy as np
import pytest

from moepack.errors import BadInput
from moepack.stream.forecast import evaluate, holdout
from moepack.stream.predictor import PREDICTORS, resolve
from moepack.trace import synth_trace
from moepack.trace.core import PromptSegment, RoutingTrace


def structured(tokens: int = 800) -> RoutingTrace:
    """Layer 1 copies layer 0; every token repeats the previous one but every 4th, which
    draws fresh experts; 4 prompts."""
    rng = np.random.default_rng(0)
    rows = []
    cur = rng.choice(16, 2, replace=False)
    for t in range(tokens):
        if t % 4 == 0:
            cur = rng.choice(16, 2, replace=False)
        rows.append(cur)
    layer = np.stack(rows).astype(np.uint8)
    ids = np.stack([layer, layer], axis=1)
    q = tokens // 4
    return RoutingTrace(ids, 16, segments=[PromptSegment(i * q, 10, q - 10) for i in range(4)])


def test_sticky_and_cross_layer_find_the_planted_structure() -> None:
    r = evaluate(structured(), ["sticky", "cross-layer", "frequency", "sticky+markov"], [2, 4])
    assert r.split.by_prompts and r.split.eval_prompts == 1
    sticky = r.score("sticky", 2)
    # 3 of every 4 tokens repeat their predecessor, a fresh draw shares 1/8 by chance
    assert 0.74 < sticky.recall < 0.82 and sticky.precision == sticky.recall
    cross = r.score("cross-layer", 2)
    assert cross.recall > 0.45  # layer 1 is certain, layer 0 falls back to the hot list
    assert r.score("frequency", 2).recall < 0.3
    assert r.score("sticky", 4).precision == pytest.approx(r.score("sticky", 4).recall / 2)


def test_one_prompt_holds_out_its_last_quarter_and_says_so() -> None:
    t = synth_trace(tokens=400, layers=2, n_expert=16, top_k=2, seed=0)
    split = holdout(t)
    assert split.train_rows.size == 300 and split.eval_rows[0] == 300
    r = evaluate(t, ["markov"], [2])
    assert any("last quarter" in n for n in r.notes)


def test_unknown_predictor_and_bad_budget_are_bad_input() -> None:
    with pytest.raises(BadInput, match="unknown predictor 'oracle'"):
        resolve("sticky+oracle")
    with pytest.raises(BadInput, match="fetch budget"):
        evaluate(structured(), ["sticky"], [0])
    assert {"frequency", "sticky", "markov", "cross-layer"} <= set(PREDICTORS.names())
