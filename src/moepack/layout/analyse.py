"""``moepack analyse``: what each layout would cost this model for this workload, per layer.

For each MoE block: its experts and slice sizes, and per layout the requests and bytes per
token, the predicted read time per token (with a surface), the speedup over the file as it is
and a verdict. With ``measure`` the layouts' reads are replayed against the real file, cold,
and the measured time per token is shown beside the prediction, for the same tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..blocklist import format_index_list
from ..checkpoint.model import MoeModel
from ..errors import BadInput
from ..storage.device import describe_device
from ..storage.modes import Mode
from ..storage.surface import Surface
from ..trace.core import RoutingTrace
from .cost import CostOptions, LayoutCost, SurfaceFit, layout_cost
from .layout import LayoutOptions, LayoutPlacement, place, resolve_layout
from .plan import Plan, load_plan
from .replay import ReplayResult, replay

DEFAULT_LAYOUTS = ("identity", "pipeline", "fused", "expert-major")
WORTH_IT = 1.05
"""A layout must be at least this much faster than the file as it is to be recommended."""


@dataclass
class LayerRow:
    """One MoE block's figures under every layout."""

    layer: int
    block: int
    experts: int
    slice_kib: dict[str, float]
    requests: dict[str, float]
    bytes: dict[str, float]
    predicted_us: dict[str, float | None]

    def speedup(self, layout: str) -> float:
        """Identity's cost over ``layout``'s: time when known, else requests."""
        base, this = self.predicted_us.get("identity"), self.predicted_us.get(layout)
        if base is not None and this:
            return base / this
        return self.requests["identity"] / self.requests[layout] if self.requests[layout] else 1.0

    @property
    def best(self) -> str:
        return max(self.requests, key=lambda name: (self.speedup(name), name == "identity"))

    @property
    def verdict(self) -> str:
        best = self.best
        if best == "identity" or self.speedup(best) < WORTH_IT:
            return "leave alone"
        return f"{best} ({self.speedup(best):.2f}x)"

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "block": self.block,
            "experts": self.experts,
            "slice_kib": self.slice_kib,
            "requests_per_token": self.requests,
            "bytes_per_token": self.bytes,
            "predicted_us_per_token": self.predicted_us,
            "speedup": {name: self.speedup(name) for name in self.requests},
            "verdict": self.verdict,
        }


@dataclass
class AnalyseResult:
    """Every layout's cost, per layer and in total; measured replays when asked for."""

    model: Path
    trace: Path | None
    tokens: tuple[int, int]
    layouts: list[str]
    costs: list[LayoutCost]
    rows: list[LayerRow]
    options: CostOptions
    fit: SurfaceFit | None
    replays: list[ReplayResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plot: Path | None = None

    def cost(self, layout: str) -> LayoutCost:
        return next(c for c in self.costs if c.layout == layout)

    def speedup(self, layout: str) -> float:
        """Predicted over all blocks: identity's time (or requests) over ``layout``'s."""
        base, this = self.cost("identity"), self.cost(layout)
        bt, tt = base.time_per_token, this.time_per_token
        if bt is not None and tt:
            return bt / tt
        return base.requests_per_token / this.requests_per_token

    def measured_speedup(self, layout: str) -> float | None:
        by = {r.layout: r for r in self.replays}
        if "identity" not in by or layout not in by or not by[layout].seconds:
            return None
        return by["identity"].seconds / by[layout].seconds

    def to_json(self) -> dict[str, Any]:
        return {
            "model": str(self.model),
            "trace": str(self.trace) if self.trace else None,
            "tokens": list(self.tokens),
            "layouts": self.layouts,
            "merge_gap": self.options.merge_gap,
            "cache": self.options.cache,
            "queue_depth": self.options.queue_depth,
            "fit": self.fit.to_json() if self.fit else None,
            "summary": {
                name: {
                    "requests_per_token": self.cost(name).requests_per_token,
                    "bytes_per_token": self.cost(name).bytes_per_token,
                    "predicted_us_per_token": _us(self.cost(name).time_per_token),
                    "speedup": self.speedup(name),
                    "measured_speedup": self.measured_speedup(name),
                }
                for name in self.layouts
            },
            "layers": [r.to_json() for r in self.rows],
            "replays": [r.to_json() for r in self.replays],
            "notes": self.notes,
            "plot": str(self.plot) if self.plot else None,
        }


def _us(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e6


def parse_token_range(text: str | None, n_tokens: int) -> tuple[int, int]:
    """``START:END`` (either side may be empty; negatives count from the end) -> a range."""
    if not text:
        return 0, n_tokens
    try:
        lo_s, hi_s = text.split(":")
        lo = int(lo_s) if lo_s else 0
        hi = int(hi_s) if hi_s else n_tokens
    except ValueError:
        raise BadInput(f"token range must be START:END, got {text!r}") from None
    lo, hi = (lo + n_tokens if lo < 0 else lo), (hi + n_tokens if hi < 0 else hi)
    if not 0 <= lo < hi <= n_tokens:
        raise BadInput(f"token range {text!r} is empty or outside the trace's {n_tokens} tokens")
    return lo, hi


def covered_blocks(model: MoeModel, trace: RoutingTrace) -> list[int]:
    """The trace's block map on ``model``; ``BadInput`` naming the MoE blocks it leaves out."""
    block_map = trace.check_against(model)
    missing = [b for b in model.moe_block_indices if b not in block_map]
    if missing:
        raise BadInput(
            f"trace covers only some MoE blocks; not covered: {format_index_list(missing, ', ')}",
            trace.path,
        )
    return block_map


def surface_warnings(surface: Surface, model_path: Path) -> list[str]:
    """A warning when the surface was measured on another device than the model sits on."""
    if not surface.device:
        return ["the surface does not say which device it was measured on"]
    here = describe_device(model_path)
    theirs = surface.device
    for key in ("block_device", "model", "filesystem"):
        a, b = theirs.get(key), getattr(here, key)
        if a and b and a != b:
            return [
                f"the surface was measured on another device ({key} {a}, the model is on {b}): "
                "its times may not hold here"
            ]
    return []


def _placements(
    model: MoeModel, layouts: list[str], explicit: bool, opts: LayoutOptions
) -> tuple[list[LayoutPlacement], list[str]]:
    placements, notes = [], []
    for name in layouts:
        try:
            placements.append(place(model, name, opts))
        except BadInput as e:
            if explicit:
                raise
            notes.append(f"layout {name} left out: {e.message}")
    return placements, notes


def analyse(
    model_path: str | os.PathLike[str],
    trace: RoutingTrace | str | os.PathLike[str],
    layouts: list[str] | None = None,
    plan_path: str | os.PathLike[str] | Plan | None = None,
    surface: Surface | str | os.PathLike[str] | None = None,
    options: CostOptions | None = None,
    token_range: str | None = None,
    measure: bool = False,
    measure_tokens: int = 256,
    engine: str = "pread",
    mode: Mode = Mode.DIRECT,
    plot: str | os.PathLike[str] | None = None,
    n_expert: int | None = None,
    block_map: list[int] | None = None,
) -> AnalyseResult:
    """Cost (and with ``measure``, replay) each layout of ``model_path`` for ``trace``
    (a ``RoutingTrace`` or a trace file; ``block_map`` replaces the one it records)."""
    options = options or CostOptions()
    options.check()
    if measure_tokens < 1:
        raise BadInput(f"--measure-tokens must be at least 1, got {measure_tokens}")
    if surface is not None and not isinstance(surface, Surface):
        surface = Surface.load(surface)
    with MoeModel(model_path) as model:
        trace = _trace(trace, model, n_expert, block_map)
        if trace.tokens == 0:
            raise BadInput("trace has no tokens", trace.path)
        covered = covered_blocks(model, trace)
        plan: Plan | None = None
        if isinstance(plan_path, Plan):
            plan = plan_path
            plan.check_against(model)
        elif plan_path is not None:
            plan = load_plan(plan_path)
            plan.check_against(model, plan_path)
        explicit = layouts is not None
        names = list(layouts) if layouts else list(DEFAULT_LAYOUTS)
        if plan is not None and not explicit:
            names.insert(1, "reorder")
        names = [resolve_layout(n).name for n in names]
        if "identity" not in names:
            names.insert(0, "identity")
        placements, notes = _placements(model, names, explicit, LayoutOptions(plan=plan))
        lo, hi = parse_token_range(token_range, trace.tokens)
        ids = np.asarray(trace.ids[lo:hi], dtype=np.int64)
        if measure:
            # predicted and measured over exactly the same tokens
            hi = min(hi, lo + measure_tokens)
            ids = ids[: hi - lo]
        costs = [layout_cost(p, ids, covered, options, surface) for p in placements]
        if surface is not None:
            notes += surface_warnings(surface, model.path)
        else:
            notes.append("no surface: only requests and bytes are compared, not read time")
        replays = (
            [replay(model, p, ids, covered, options, surface, engine, mode) for p in placements]
            if measure
            else []
        )
        rows = _rows(model, covered, costs)
    result = AnalyseResult(
        Path(model_path),
        trace.path,
        (lo, hi),
        [p.name for p in placements],
        costs,
        rows,
        options,
        costs[0].fit,
        replays,
        notes,
    )
    if plot is not None:
        from .analyse_plot import write_speedup_plot

        result.plot = write_speedup_plot(result, Path(plot))
    return result


def _trace(
    trace: RoutingTrace | str | os.PathLike[str],
    model: MoeModel,
    n_expert: int | None,
    block_map: list[int] | None,
) -> RoutingTrace:
    if not isinstance(trace, RoutingTrace):
        from ..trace.formats import load_trace

        trace = load_trace(trace, n_expert=n_expert, model=model, check=False)
    if block_map is not None:
        trace = trace.replace(block_map=list(block_map))
    return trace


def _rows(model: MoeModel, block_map: list[int], costs: list[LayoutCost]) -> list[LayerRow]:
    """Per block; measured times are per layout only (a replay streams all blocks at once)."""
    rows = []
    for layer, b in enumerate(block_map):
        blk = model.block(b)
        rows.append(
            LayerRow(
                layer,
                b,
                blk.n_expert,
                {t.name: t.slice_bytes / 1024 for t in blk.weight_tensors},
                {c.layout: c.block(b).requests_per_token for c in costs},
                {c.layout: c.block(b).bytes_per_token for c in costs},
                {c.layout: _us(c.block(b).time_per_token) for c in costs},
            )
        )
    return rows
