"""Score a plan on tokens it was not made from: split a captured trace by whole prompts, plan
on the first part, count read requests per token on the rest.

A plan scored on its own trace flatters itself (the chain was fitted to exactly those
co-activations); whole prompts held out show what a new workload of the same kind gains.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checkpoint.model import MoeModel
from ..errors import BadInput
from ..llama.capture import token_prompts
from ..trace.core import RoutingTrace
from .coactivation_plan import runs_per_token
from .plan import Plan


@dataclass
class PromptSplit:
    """The first ``train_prompts`` prompts of a trace, and the prompts after them."""

    train: RoutingTrace
    held_out: RoutingTrace
    train_prompts: int
    held_out_prompts: int

    def to_json(self) -> dict[str, int]:
        return {
            "train_prompts": self.train_prompts,
            "train_tokens": self.train.tokens,
            "held_out_prompts": self.held_out_prompts,
            "held_out_tokens": self.held_out.tokens,
        }


def _rows(trace: RoutingTrace, rows: slice) -> RoutingTrace:
    weights = None if trace.weights is None else trace.weights[rows]
    ids = trace.ids[rows]
    provenance = {k: v for k, v in trace.provenance.items() if k != "capture"}
    prefill = min(trace.prefill_tokens, len(ids)) if rows.start == 0 else 0
    return trace.replace(ids=ids, weights=weights, prefill_tokens=prefill, provenance=provenance)


def split_by_prompts(trace: RoutingTrace, train_prompts: int) -> PromptSplit:
    """Cut a captured trace (prompts are contiguous) after its first ``train_prompts``."""
    owner = token_prompts(trace)
    if owner.size == 0 or owner.min() < 0:
        raise BadInput("the trace records no prompts to split by (capture it)", trace.path)
    n = int(owner.max()) + 1
    if not 0 < train_prompts < n:
        raise BadInput(f"cannot hold out prompts: {train_prompts} of {n} for planning", trace.path)
    cut = int(np.searchsorted(owner, train_prompts))
    return PromptSplit(
        _rows(trace, slice(0, cut)),
        _rows(trace, slice(cut, trace.tokens)),
        train_prompts,
        n - train_prompts,
    )


def requests_per_token(model: MoeModel, trace: RoutingTrace, plan: Plan) -> tuple[float, float]:
    """Read requests per token over ``trace`` in the checkpoint's order and in ``plan``'s,
    summed over MoE blocks (contiguous runs of chosen slots times the expert matrices)."""
    blocks = trace.check_against(model)
    by_index = {b.index: b for b in model.blocks}
    perms = {lp.block: lp.perm for lp in plan.layers}
    before = after = 0.0
    for layer, b in enumerate(blocks):
        block = by_index[b]
        n = block.n_expert
        ids = np.asarray(trace.ids[:, layer, :])
        tensors = max(1, len(block.weight_tensors))
        slot_of = np.arange(n, dtype=np.int64)
        if b in perms:
            slot_of[np.asarray(perms[b], dtype=np.int64)] = np.arange(n)
        before += runs_per_token(ids, np.arange(n)) * tensors
        after += runs_per_token(ids, slot_of) * tensors
    return before, after
