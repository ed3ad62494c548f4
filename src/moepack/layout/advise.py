"""``moepack advise``: ranked, plain-language recommendations with the numbers behind each.

Built on ``analyse``: a co-activation plan is made on the first half of the trace (whole
prompts when it records them) and every layout (reorder with that plan among them) is judged
on the rest, so a reorder's gain is not the trace fitting itself; a fused layout is advised
only for an architecture whose llama.cpp loader takes it. Then, from the surface: the queue depth this device wants for
these slice sizes; from the trace: the LRU cache size per block that buys a given hit rate.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..checkpoint.fused_archs import takes_fused_gate_up
from ..checkpoint.model import MoeModel
from ..errors import BadInput
from ..storage.surface import Surface
from ..trace.core import RoutingTrace
from ..trace.stackdist import hit_curve, stack_distances
from .analyse import WORTH_IT, AnalyseOptions, AnalyseResult, _trace, analyse
from .coactivation_plan import plan_from_trace
from .cost import CostOptions
from .heldout import split_held_out

HIT_TARGETS = (0.5, 0.8, 0.9)
WORDS = {
    "identity": "leave the file alone",
    "reorder": "reorder each block's experts (moepack plan + repack)",
    "pipeline": "pack each block's expert tensors in execution order (repack)",
    "fused": "fuse gate and up into one tensor (repack)",
    "expert-major": "build an expert-major store (each expert's slices adjacent)",
}


@dataclass
class Advice:
    """One recommendation and the figures it rests on."""

    title: str
    detail: str
    figures: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"title": self.title, "detail": self.detail, "figures": self.figures}


@dataclass
class AdviseResult:
    advice: list[Advice]
    analysis: AnalyseResult
    notes: list[str] = field(default_factory=list)

    @property
    def warnings(self) -> list[str]:
        """The analysis's: inputs bound to the model by their shape only."""
        return self.analysis.warnings

    def to_json(self) -> dict[str, Any]:
        return {
            "advice": [a.to_json() for a in self.advice],
            "analysis": self.analysis.to_json(),
            "notes": self.notes,
            "warnings": self.warnings,
        }


def _describe(layout: str) -> str:
    return " and ".join(WORDS.get(p, p) for p in layout.split("+"))


def advise(
    model_path: str | os.PathLike[str],
    trace: RoutingTrace | str | os.PathLike[str],
    surface: Surface | str | os.PathLike[str] | None = None,
    queue_depth: int = 1,
    n_expert: int | None = None,
    block_map: list[int] | None = None,
) -> AdviseResult:
    """Recommendations for ``model_path`` under ``trace``: planned on its first half and
    judged on the rest (whole prompts when the trace records them); a fused layout only where
    llama.cpp loads it."""
    if surface is not None and not isinstance(surface, Surface):
        surface = Surface.load(surface)
    with MoeModel(model_path) as model:
        tr = _trace(trace, model, n_expert, block_map).bound_to(model)
        if tr.tokens < 2:
            raise BadInput(
                "advice needs a trace of at least 2 tokens (plan on one half, judge on the other)",
                tr.path,
            )
        split = split_held_out(tr, 0.5)  # whole prompts when the trace records them
        half = split.held_range[0]
        plan = plan_from_trace(model, tr.replace(ids=tr.ids[:half].copy())).plan
        slice_bytes = [t.slice_bytes for b in model.blocks for t in b.weight_tensors]
        architecture = model.architecture
        drop_in_fused = takes_fused_gate_up(architecture)
    options = AnalyseOptions(cost=CostOptions(queue_depth=queue_depth), token_range=f"{half}:")
    result = analyse(model_path, tr, options, plan=plan, surface=surface)
    ranked = sorted(
        (n for n in result.layouts if n != "identity"), key=result.speedup, reverse=True
    )
    advice: list[Advice] = []
    notes = list(result.notes)
    unit = "faster reads" if result.fit else "fewer read requests"
    for name in ranked:
        g = result.speedup(name)
        if g < WORTH_IT:
            continue
        parts = name.split("+")  # an expert-major store is not loaded by llama.cpp: any arch
        if "fused" in parts and "expert-major" not in parts and not drop_in_fused:
            notes.append(
                f"{name} would give {g:.2f}x {unit}, but llama.cpp's loader for "
                f"{architecture!r} does not take a fused ffn_gate_up_exps: not recommended"
            )
            continue
        c = result.cost(name)
        advice.append(
            Advice(
                f"{_describe(name)}: {g:.2f}x {unit}",
                f"on the held-out tokens {result.tokens[0]}:{result.tokens[1]}, "
                f"{c.requests_per_token:.1f} requests per token instead of "
                f"{result.cost('identity').requests_per_token:.1f}",
                {"layout": name, "speedup": g, "requests_per_token": c.requests_per_token},
            )
        )
    if not advice:
        best = ranked[0] if ranked else "identity"
        advice.append(
            Advice(
                "leave the file alone",
                f"no layout is {WORTH_IT:.2f}x better on the held-out tokens (best: {best}, "
                f"{result.speedup(best):.3f}x)",
                {"best": best, "speedup": result.speedup(best)},
            )
        )
    if surface is not None:
        advice.append(_depth_advice(surface, int(np.median(slice_bytes))))
    advice.append(_cache_advice(tr, half))
    if split.by == "prompts":
        notes.append(
            f"planned on prompts 1-{split.train_prompts}, judged on the other "
            f"{split.held_prompts} (tokens {half}:{tr.tokens})"
        )
    return AdviseResult(advice, result, notes)


def _depth_advice(surface: Surface, size: int) -> Advice:
    depths = surface.queue_depths
    bws = {qd: surface.bandwidth(size, qd) for qd in depths}
    best = min(qd for qd in depths if bws[qd] >= 0.95 * max(bws.values()))
    return Advice(
        f"read with queue depth {best} ({surface.engine or 'the probed engine'})",
        f"at {size / 1024:.0f} KiB slices this device gives {bws[depths[0]] / 1e9:.2f} GB/s at "
        f"depth {depths[0]} and {bws[best] / 1e9:.2f} GB/s at depth {best} (95 % of its best)",
        {"slice_bytes": size, "queue_depth": best, "gbps": {q: b / 1e9 for q, b in bws.items()}},
    )


def _cache_advice(trace: RoutingTrace, start: int) -> Advice:
    curves = np.stack(
        [
            hit_curve(stack_distances(trace.ids[start:, layer, :], trace.n_expert), trace.n_expert)
            for layer in range(trace.layers)
        ]
    )
    mean = np.nanmean(curves, axis=0)
    sizes = {}
    for target in HIT_TARGETS:
        reach = np.flatnonzero(mean >= target)
        sizes[target] = int(reach[0]) + 1 if reach.size else None
    parts = [
        f"{int(t * 100)} % hits: {n} experts" if n else f"{int(t * 100)} %: not reachable"
        for t, n in sizes.items()
    ]
    return Advice(
        "per-block expert cache (LRU)",
        "; ".join(parts) + f" per block (mean over {trace.layers} layers, held-out tokens)",
        {"experts_for_hit_rate": {str(t): n for t, n in sizes.items()}},
    )
