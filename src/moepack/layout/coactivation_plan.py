"""A first planner: order each block's experts so that experts chosen together sit together.

Per MoE block: a greedy chain over the trace's co-activation counts (start from the busiest
expert, then repeatedly place the unplaced expert most co-activated with the last ``k`` placed),
scored by the number of read requests a token needs — contiguous runs of chosen slots, times
the block's expert matrices. Where llama.cpp reads expert indices (grouped routing), the chain
runs inside each group and then orders whole groups, so the plan never changes the model. A block keeps the checkpoint's own order unless the new order needs
fewer requests (the peer could end worse than where it started; this cannot). The full optimiser
with a storage cost model comes later; this one is honest about what it measures: requests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..binding import basis, shape_only_warning
from ..checkpoint.expert_index import PlanningUnits, planning_units
from ..checkpoint.model import MoeModel
from ..errors import BadInput
from ..trace.chain import greedy_chain, runs_per_token
from ..trace.core import RoutingTrace
from ..trace.stats import coactivation, expert_counts
from .plan import LayerPlan, Plan


def constrained_chain(
    coact: np.ndarray,
    counts: np.ndarray,
    window: int,
    units: PlanningUnits,
    order_groups: bool = True,
) -> np.ndarray:
    """``greedy_chain`` inside each run of ``units.size`` experts (experts below
    ``units.fixed`` stay put); when the runs may move as wholes and ``order_groups``, the runs
    are then chained the same way over their summed co-activation."""
    n = len(counts)
    size = units.size
    if size >= n and units.fixed == 0:
        return greedy_chain(coact, counts, window)
    n_units = n // size
    inner: list[np.ndarray] = []
    for u in range(n_units):
        members = np.arange(u * size, (u + 1) * size)
        free = members[members >= units.fixed]
        head = members[members < units.fixed]
        if len(free) > 1:
            sub = greedy_chain(coact[np.ix_(free, free)], counts[free], window)
            free = free[sub]
        inner.append(np.concatenate([head, free]).astype(np.int64))
    order = np.arange(n_units)
    if units.movable and order_groups and n_units > 1:
        m = n_units * size
        unit_coact = coact[:m, :m].astype(np.float64)
        unit_coact = unit_coact.reshape(n_units, size, n_units, size).sum(axis=(1, 3))
        np.fill_diagonal(unit_coact, 0)
        unit_counts = counts[:m].astype(np.float64).reshape(n_units, size).sum(axis=1)
        order = greedy_chain(unit_coact, unit_counts, max(1, units.groups_used))
    tail = np.arange(n_units * size, n, dtype=np.int64)  # experts outside every run stay put
    return np.concatenate([inner[u] for u in order] + [tail])


@dataclass
class LayerOutcome:
    block: int
    requests_before: float
    requests_after: float
    speedup: float
    changed: bool


@dataclass
class PlanOutcome:
    plan: Plan
    layers: list[LayerOutcome]
    trace_tokens: int
    phase: str
    map_block: int | None = None
    map_png: bytes | None = field(default=None, repr=False)
    warnings: list[str] = field(default_factory=list)
    held_out: dict[str, Any] | None = None
    """With ``holdout``: how the trace was split and the requests per token on the held-out
    part before and after the plan (made on the other part), and the gap to the training part."""

    def to_json(self) -> dict[str, object]:
        return {
            "plan": self.plan.to_json(),
            "warnings": list(self.warnings),
            "layers": [vars(x) for x in self.layers],
            "trace_tokens": self.trace_tokens,
            "phase": self.phase,
            "requests_before": self.requests_before,
            "requests_after": self.requests_after,
            "map_block": self.map_block,
            "held_out": self.held_out,
        }

    @property
    def requests_before(self) -> float:
        return sum(x.requests_before for x in self.layers)

    @property
    def requests_after(self) -> float:
        return sum(x.requests_after for x in self.layers)


def plan_from_trace(
    model: MoeModel,
    trace: RoutingTrace,
    phase: str = "all",
    model_label: str | os.PathLike[str] | None = None,
    trace_label: str | os.PathLike[str] | None = None,
    order_groups: bool = True,
) -> PlanOutcome:
    """A plan for ``model`` from ``trace`` (checked against the model first).

    Blocks where llama.cpp reads expert indices (grouped routing, chunk experts; see
    ``checkpoint.expert_index``) are planned within their groups; ``order_groups`` also
    reorders whole routing groups where that is allowed."""
    blocks = trace.check_against(model)
    rows = trace.phase_rows(phase)  # a slice, or every prompt's rows of the phase
    n_rows = trace.phase_tokens(phase)
    if n_rows == 0:
        raise BadInput(f"the trace has no {phase} tokens to plan from", trace.path)
    counts_all = expert_counts(trace, phase)
    layers: list[LayerPlan] = []
    outcomes: list[LayerOutcome] = []
    by_index = {b.index: b for b in model.blocks}
    for layer, b in enumerate(blocks):
        block = by_index[b]
        n = block.n_expert
        ids = np.asarray(trace.ids[rows, layer, :])
        tensors = max(1, len(block.weight_tensors))
        before = runs_per_token(ids, np.arange(n)) * tensors
        units = planning_units(block.constraints, n)
        perm = constrained_chain(
            coactivation(trace, layer, phase), counts_all[layer], trace.k, units, order_groups
        )
        why = block.violation(perm)
        if why is not None:  # the chain keeps every rule by construction
            raise AssertionError(f"block {b}: planner broke a rule: {why}")
        slot_of = np.empty(n, dtype=np.int64)
        slot_of[perm] = np.arange(n)
        after = runs_per_token(ids, slot_of) * tensors
        changed = after < before
        if not changed:
            perm, after = np.arange(n, dtype=np.int64), before
        speedup = before / after if after else 1.0
        layers.append(LayerPlan(b, perm, [t.name for t in block.tensors], before, after, speedup))
        outcomes.append(LayerOutcome(b, before, after, speedup, changed))
    plan = Plan(
        layers,
        model.fingerprint,
        str(model_label or model.path),
        str(trace_label) if trace_label else (str(trace.path) if trace.path else None),
        source="coactivation greedy chain (requests per token)",
        trace_binding=basis(trace.model_fingerprint),
    )
    warnings = []
    if trace.model_fingerprint is None:
        warnings.append(shape_only_warning("trace", trace_label or trace.path, model.path))
    return PlanOutcome(plan, outcomes, n_rows, phase, warnings=warnings)


def order_map_png(
    trace: RoutingTrace, blocks: list[int], plan: Plan, block: int, phase: str = "all"
) -> bytes:
    """The co-activation map (PNG) of ``block`` (``blocks``: the trace's layers' blocks) in
    the file's order and in ``plan``'s."""
    from .coactivation_map import coactivation_png

    if block not in blocks:
        raise BadInput(f"block {block} is not a MoE block covered by the trace", trace.path)
    coact = coactivation(trace, blocks.index(block), phase)
    perm = plan.perm_for(block)
    return coactivation_png(
        coact,
        perm if perm is not None else np.arange(coact.shape[0], dtype=np.int64),
        f"block {block}: co-activation over {trace.tokens:,} tokens",
    )


def plan_files(
    model_path: str | os.PathLike[str],
    trace_path: str | os.PathLike[str],
    *,
    n_expert: int | None = None,
    phase: str = "all",
    draw_map: bool = False,
    map_block: int | None = None,
    block_map: list[int] | None = None,
    order_groups: bool = True,
    holdout: float | None = None,
) -> PlanOutcome:
    """``plan_from_trace`` for files (the trace is read and bound to the model; ``block_map``
    says which MoE block each trace layer is, for traces that don't record it). With
    ``draw_map``, also a co-activation map (PNG) of ``map_block`` — by default the block
    whose requests the plan cuts most."""
    from ..trace.formats import load_trace

    with MoeModel(model_path) as model:
        # plan_from_trace checks the trace against the model (once)
        trace = load_trace(trace_path, n_expert=n_expert, model=model, check=False)
        if block_map is not None:
            trace = trace.replace(block_map=block_map)
        split = None
        if holdout is not None:
            from .heldout import held_out_traces, requests_per_token, split_held_out

            split = split_held_out(trace, holdout)
            train, held = held_out_traces(trace, split)
            outcome = plan_from_trace(
                model, train, phase, Path(model_path), Path(trace_path), order_groups
            )
            before, after = requests_per_token(model, held, outcome.plan)
            train_gain = (
                outcome.requests_before / outcome.requests_after if outcome.requests_after else 1.0
            )
            held_gain = before / after if after else 1.0
            outcome.held_out = {
                **split.to_json(),
                "requests_before": before,
                "requests_after": after,
                "held_out_gain": held_gain,
                "train_gain": train_gain,
                "gap": train_gain - held_gain,
            }
        else:
            outcome = plan_from_trace(
                model, trace, phase, Path(model_path), Path(trace_path), order_groups
            )
        if draw_map:
            from .coactivation_map import coactivation_png

            blocks = [x.block for x in outcome.layers]
            if map_block is None:
                map_block = max(outcome.layers, key=lambda x: x.speedup).block
            if map_block not in blocks:
                raise BadInput(
                    f"block {map_block} is not a MoE block covered by the trace", trace_path
                )
            layer = blocks.index(map_block)
            coact = coactivation(trace, layer, phase)
            perm = outcome.plan.layers[layer].perm
            outcome.map_block = map_block
            outcome.map_png = coactivation_png(
                coact,
                perm,
                f"block {map_block}: co-activation over {outcome.trace_tokens:,} tokens",
            )
        return outcome
