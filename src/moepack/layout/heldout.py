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
from ..trace.chain import runs_per_token
from ..trace.core import RoutingTrace
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


def _prompts(trace: RoutingTrace, first: int, stop: int) -> RoutingTrace:
    """Whole prompts ``first .. stop - 1``; the capture's per-prompt record stays with the
    full trace (the part's own segments say where its prompts are)."""
    part = trace.prompt_slice(first, stop)
    provenance = {k: v for k, v in part.provenance.items() if k != "capture"}
    return part.replace(provenance=provenance)


def split_by_prompts(trace: RoutingTrace, train_prompts: int) -> PromptSplit:
    """Cut a trace of several prompts (``RoutingTrace.prompt_segments``) after its first
    ``train_prompts``."""
    n = trace.prompts
    if n < 2:
        raise BadInput(
            "the trace records a single prompt, no prompts to split by (capture several)",
            trace.path,
        )
    if not 0 < train_prompts < n:
        raise BadInput(f"cannot hold out prompts: {train_prompts} of {n} for planning", trace.path)
    return PromptSplit(
        _prompts(trace, 0, train_prompts),
        _prompts(trace, train_prompts, n),
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


@dataclass(frozen=True)
class HeldOutSplit:
    """Which token rows a plan or an analysis is made on and which it is judged on: whole
    prompts when the trace records several, else the last tokens."""

    by: str  # "prompts" or "tokens"
    train_rows: np.ndarray
    held_rows: np.ndarray
    train_prompts: int | None = None
    held_prompts: int | None = None

    @property
    def train_range(self) -> tuple[int, int]:
        return int(self.train_rows[0]), int(self.train_rows[-1]) + 1

    @property
    def held_range(self) -> tuple[int, int]:
        return int(self.held_rows[0]), int(self.held_rows[-1]) + 1

    def to_json(self) -> dict[str, object]:
        return {
            "by": self.by,
            "train_tokens": list(self.train_range),
            "held_out_tokens": list(self.held_range),
            "train_prompts": self.train_prompts,
            "held_out_prompts": self.held_prompts,
        }


def split_held_out(trace: RoutingTrace, holdout: float) -> HeldOutSplit:
    """Hold out about ``holdout`` of the tokens: the last whole prompts (at least one, leaving
    at least one) when the trace records two or more, else the last tokens."""
    if not 0 < holdout < 1:
        raise BadInput(f"`holdout` must be between 0 and 1, got {holdout}")
    n = trace.tokens
    if trace.prompts >= 2:
        segs = trace.prompt_segments
        want = n * (1 - holdout)
        # the first prompt boundary at or past the wanted split, within 1 .. prompts - 1
        cut = next((i for i, s in enumerate(segs) if s.stop >= want), len(segs) - 1) + 1
        cut = min(max(cut, 1), len(segs) - 1)
        split = segs[cut].start
        return HeldOutSplit(
            "prompts",
            np.arange(split, dtype=np.int64),
            np.arange(split, n, dtype=np.int64),
            cut,
            len(segs) - cut,
        )
    split = int(round(n * (1 - holdout)))
    if split < 1 or split >= n:
        raise BadInput(
            f"the trace's {n} tokens cannot be split into training and held-out parts",
            trace.path,
        )
    return HeldOutSplit(
        "tokens", np.arange(split, dtype=np.int64), np.arange(split, n, dtype=np.int64)
    )


def held_out_traces(trace: RoutingTrace, split: HeldOutSplit) -> tuple[RoutingTrace, RoutingTrace]:
    """The two parts of ``split`` as traces (whole prompts keep their segments)."""
    if split.by == "prompts" and split.train_prompts is not None:
        n = trace.prompts
        return _prompts(trace, 0, split.train_prompts), _prompts(trace, split.train_prompts, n)
    cut = int(split.held_rows[0])
    w = trace.weights

    def part(a: int, b: int, prefill: int) -> RoutingTrace:
        provenance = {k: v for k, v in trace.provenance.items() if k != "capture"}
        return trace.replace(
            ids=trace.ids[a:b],
            weights=None if w is None else w[a:b],
            prefill_tokens=prefill,
            segments=None,
            provenance=provenance,
        )

    pre = trace.prefill_tokens if trace.segments is None else 0
    return part(0, cut, min(pre, cut)), part(cut, trace.tokens, max(0, pre - cut))
