"""``moepack analyse``: what each layout would cost this model for this workload, per layer.

For each MoE block: its experts and slice sizes, and per layout the requests and bytes per
token, the predicted read time per token (with a surface), the speedup over the file as it is
and a verdict. With ``measure`` the layouts' reads are replayed against the real file, cold,
interleaved by chunks of tokens (``replay.replay_layouts``), and the measured time per token,
in total and per block, is shown beside the prediction, for the same tokens; with ``probe``
the surface is measured in the same loop, on the model file, at the sizes the replay issues.
With ``holdout`` the layouts are judged on held-out tokens (the last whole prompts when the
trace records several) and the speedup on the rest is reported beside it, with the gap.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..binding import shape_only_warnings
from ..blocklist import format_index_list
from ..checkpoint.fused_archs import takes_fused_gate_up
from ..checkpoint.model import MoeModel
from ..errors import BadInput
from ..filekinds import IMAGE, check_output_kind
from ..safeio import check_destination, real
from ..storage.device import describe_device
from ..storage.modes import Mode, ModeUnsupported, open_file
from ..storage.surface import Surface
from ..token_range import parse_token_range
from ..trace.core import RoutingTrace
from .cost import CostOptions, LayoutCost, SurfaceFit, block_misses, layout_cost
from .heldout import HeldOutSplit, split_held_out
from .layout import LayoutOptions, LayoutPlacement, place, resolve_layout
from .plan import Plan, load_plan
from .replay import MeasureOptions, ReplayResult, ReplaySet, replay_layouts

DEFAULT_LAYOUTS = ("identity", "pipeline", "fused", "expert-major")
WORTH_IT = 1.05
"""A layout must be at least this much faster than the file as it is to be recommended."""


@dataclass(kw_only=True)
class LayerRow:
    """One MoE block's figures under every layout."""

    layer: int
    block: int
    experts: int
    slice_kib: dict[str, float]
    requests: dict[str, float]
    bytes: dict[str, float]
    predicted_us: dict[str, float | None]
    measured_us: dict[str, float | None] = field(default_factory=dict)
    replay_predicted_us: dict[str, float | None] = field(default_factory=dict)

    def measured_speedup(self, layout: str) -> float | None:
        """Identity's measured time in this block over ``layout``'s (with ``measure``)."""
        base, this = self.measured_us.get("identity"), self.measured_us.get(layout)
        return base / this if base is not None and this else None

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
            "measured_us_per_token": self.measured_us or None,
            "replay_predicted_us_per_token": self.replay_predicted_us or None,
            "measured_speedup": (
                {name: self.measured_speedup(name) for name in self.measured_us}
                if self.measured_us
                else None
            ),
            "verdict": self.verdict,
        }


@dataclass(kw_only=True)
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
    warnings: list[str] = field(default_factory=list)  # inputs bound by their shape only
    plot: Path | None = None
    replay_set: ReplaySet | None = None
    held_out: HeldOutSplit | None = None
    train_costs: list[LayoutCost] = field(default_factory=list)
    coact_plot: Path | None = None

    def train_speedup(self, layout: str) -> float | None:
        """With ``holdout``: the speedup on the tokens not held out (what a plan was made on)."""
        by = {c.layout: c for c in self.train_costs}
        if "identity" not in by or layout not in by:
            return None
        base, this = by["identity"], by[layout]
        bt, tt = base.time_per_token, this.time_per_token
        if bt is not None and tt:
            return bt / tt
        return base.requests_per_token / this.requests_per_token

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
        """Median over the replay's chunks of identity's time over ``layout``'s."""
        if self.replay_set is not None and layout in self.layouts:
            return self.replay_set.measured_speedup(layout)
        by = {r.layout: r for r in self.replays}
        if "identity" not in by or layout not in by or not by[layout].seconds:
            return None
        return by["identity"].seconds / by[layout].seconds

    def replay_predicted_speedup(self, layout: str) -> float | None:
        """The same median over chunks, of the prediction for exactly the spans read."""
        if self.replay_set is None or self.replay_set.result(layout).predicted_seconds is None:
            return None
        return self.replay_set.predicted_speedup(layout)

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
                    "replay_predicted_speedup": self.replay_predicted_speedup(name),
                    "train_speedup": self.train_speedup(name),
                    "gap": (
                        None
                        if self.train_speedup(name) is None
                        else self.train_speedup(name) - self.speedup(name)  # type: ignore[operator]
                    ),
                }
                for name in self.layouts
            },
            "held_out": self.held_out.to_json() if self.held_out else None,
            "probed_surface": (
                self.replay_set.surface.to_json()
                if self.replay_set is not None and self.replay_set.surface is not None
                else None
            ),
            "layers": [r.to_json() for r in self.rows],
            "replays": [r.to_json() for r in self.replays],
            "notes": self.notes,
            "warnings": self.warnings,
            "plot": str(self.plot) if self.plot else None,
            "coactivation_plot": str(self.coact_plot) if self.coact_plot else None,
        }


def _us(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e6


def covered_blocks(model: MoeModel, trace: RoutingTrace) -> list[int]:
    """The trace's block map on ``model``; ``BadInput`` naming the MoE blocks it leaves out
    (but for those llama.cpp never runs, multi-token-prediction blocks: nothing reads them)."""
    block_map = trace.check_against(model)
    missing = [b for b in model.run_block_indices if b not in block_map]
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
    fused = [
        p.name
        for p in placements
        if "fused" in p.name.split("+") and "expert-major" not in p.name.split("+")
    ]
    if fused and not takes_fused_gate_up(model.architecture):
        notes.append(
            f"{', '.join(fused)}: costed only; llama.cpp's loader for {model.architecture!r} "
            "does not take a fused ffn_gate_up_exps, so repack will not write it"
        )
    return placements, notes


@dataclass(frozen=True)
class AnalyseOptions:
    """What ``analyse`` costs and on which tokens: the layouts (default ``DEFAULT_LAYOUTS``,
    with ``reorder`` when a plan is given), how reads are issued, a token range or a held-out
    share of whole prompts, and whether the reads are replayed on the real file (``measure``,
    the first ``measure_tokens`` of the judged tokens, read as ``replay`` says)."""

    layouts: tuple[str, ...] | None = None
    cost: CostOptions = field(default_factory=CostOptions)
    token_range: str | None = None
    holdout: float | None = None
    measure: bool = False
    measure_tokens: int = 256
    replay: MeasureOptions = field(default_factory=MeasureOptions)

    def check(self) -> None:
        self.cost.check()
        self.replay.check()
        if self.measure_tokens < 1:
            raise BadInput(f"`measure_tokens` must be at least 1, got {self.measure_tokens}")
        if self.replay.probe and not self.measure:
            raise BadInput("`probe` measures the surface beside the replay: it needs `measure`")
        if self.holdout is not None and self.token_range is not None:
            raise BadInput("give either `token_range` or `holdout`, not both")


def analyse(
    model_path: str | os.PathLike[str],
    trace: RoutingTrace | str | os.PathLike[str],
    options: AnalyseOptions | None = None,
    *,
    plan: str | os.PathLike[str] | Plan | None = None,
    surface: Surface | str | os.PathLike[str] | None = None,
    n_expert: int | None = None,
    block_map: list[int] | None = None,
    plot: str | os.PathLike[str] | None = None,
    coact_plot: str | os.PathLike[str] | None = None,
) -> AnalyseResult:
    """Cost (and with ``options.measure``, replay) each layout of ``model_path`` for ``trace``
    (a ``RoutingTrace`` or a trace file; ``block_map`` replaces the one it records), with
    ``plan`` (a ``Plan`` or a plan file) as the ``reorder`` layout's order; ``plot`` and
    ``coact_plot`` are PNGs to write (the speedups; the plan's co-activation map)."""
    opts = options or AnalyseOptions()
    opts.check()
    if coact_plot is not None and plan is None:
        raise BadInput("`coact_plot` draws the plan's order: it needs `plan`")
    for png in (plot, coact_plot):  # refused before the work, not after it
        if png is not None:
            check_destination(check_output_kind(png, IMAGE), [model_path])
    if surface is not None and not isinstance(surface, Surface):
        surface = Surface.load(surface)
    cost = opts.cost
    with MoeModel(model_path) as model:
        trace = _trace(trace, model, n_expert, block_map)
        if trace.tokens == 0:
            raise BadInput("trace has no tokens", trace.path)
        covered = covered_blocks(model, trace)
        warnings = shape_only_warnings(
            "trace",
            trace.model_fingerprint,
            trace.path,
            model.path,
            trace.provenance.get("binding"),
        )
        order: Plan | None = None
        if isinstance(plan, Plan):
            order = plan
            order.check_against(model)
        elif plan is not None:
            order = load_plan(plan)
            order.check_against(model, plan)
        if order is not None:
            where = None if isinstance(plan, Plan) else plan
            warnings += shape_only_warnings("plan", order.model_fingerprint, where, model.path)
        explicit = opts.layouts is not None
        names = list(opts.layouts) if opts.layouts else list(DEFAULT_LAYOUTS)
        if order is not None and not explicit:
            names.insert(1, "reorder")
        names = [resolve_layout(n).name for n in names]
        if "identity" not in names:
            names.insert(0, "identity")
        placements, notes = _placements(model, names, explicit, LayoutOptions(plan=order))
        direct = opts.replay.mode is Mode.DIRECT
        if cost.align == 0 and (direct and (opts.measure or surface is not None)):
            cost = replace(cost, align=_direct_alignment(model.path))
        all_ids = np.asarray(trace.ids, dtype=np.int64)
        split: HeldOutSplit | None = None
        train_costs: list[LayoutCost] = []
        if opts.holdout is not None:
            split = split_held_out(trace, opts.holdout)
            lo, hi = split.held_range
            train_ids = all_ids[split.train_rows]
            train_misses = block_misses(train_ids, cost.cache)
            train_costs = [
                layout_cost(p, train_ids, covered, cost, surface, train_misses) for p in placements
            ]
        else:
            lo, hi = parse_token_range(opts.token_range, trace.tokens)
        ids = all_ids[lo:hi]
        if opts.measure:
            # predicted and measured over exactly the same tokens
            hi = min(hi, lo + opts.measure_tokens)
            ids = ids[: hi - lo]
        misses = block_misses(ids, cost.cache)
        replay_set = None
        if opts.measure:
            replay_set = replay_layouts(
                model,
                placements,
                ids,
                covered,
                cost=cost,
                surface=surface,
                measure=opts.replay,
                misses=misses,
            )
            if replay_set.surface is not None:
                surface = replay_set.surface
                notes.append(
                    "surface probed beside the replay, on the model file, at the request sizes "
                    "it issued"
                )
        costs = [layout_cost(p, ids, covered, cost, surface, misses) for p in placements]
        if surface is not None:
            if not opts.replay.probe:
                notes += surface_warnings(surface, model.path)
        else:
            notes.append("no surface: only requests and bytes are compared, not read time")
        rows = _rows(model, covered, costs, replay_set)
        coact_png = None
        if coact_plot is not None and order is not None:
            coact_png = _coactivation_png(trace, covered, order, costs, all_ids)
    result = AnalyseResult(
        model=Path(model_path),
        trace=trace.path,
        tokens=(lo, hi),
        layouts=[p.name for p in placements],
        costs=costs,
        rows=rows,
        options=cost,
        fit=costs[0].fit,
        replays=replay_set.results if replay_set else [],
        notes=notes,
        warnings=warnings,
        replay_set=replay_set,
        held_out=split,
        train_costs=train_costs,
    )
    _write_plots(result, plot, coact_plot, coact_png)
    return result


def _write_plots(
    result: AnalyseResult,
    plot: str | os.PathLike[str] | None,
    coact_plot: str | os.PathLike[str] | None,
    coact_png: bytes | None,
) -> None:
    """Both plots as one group: both appear or neither."""
    from ..outputs import write_together

    files: list[tuple[Path, bytes]] = []
    if plot is not None:
        from .analyse_plot import speedup_png

        files.append((Path(plot), speedup_png(result)))
    if coact_plot is not None and coact_png is not None:
        files.append((Path(coact_plot), coact_png))
    if not files:
        return
    if len(files) == 2 and real(files[0][0]) == real(files[1][0]):
        raise BadInput("`plot` and `coact_plot` name the same file", files[1][0])
    write_together(files, [result.model, *([result.trace] if result.trace else [])])
    if plot is not None:
        result.plot = Path(plot)
    if coact_plot is not None:
        result.coact_plot = Path(coact_plot)


def _coactivation_png(
    trace: RoutingTrace, block_map: list[int], plan: Plan, costs: list[LayoutCost], ids: np.ndarray
) -> bytes:
    """The co-activation map (over all of ``ids``: the whole trace) of the block the plan's
    order helps most on the judged tokens, in the file's order and in the plan's."""
    from .coactivation_map import coactivation_png

    perms = {lp.block: lp.perm for lp in plan.layers}
    by = {c.layout: c for c in costs}
    base = by["identity"]
    after = by.get("reorder")

    def gain(b: int) -> float:
        if after is None:
            return 0.0
        return base.block(b).requests_per_token / max(after.block(b).requests_per_token, 1e-12)

    candidates = [b for b in block_map if b in perms] or block_map
    block = max(candidates, key=gain)
    layer = block_map.index(block)
    rows = ids[:, layer, :]
    n = int(max(int(rows.max()) + 1, len(perms.get(block, []))))
    onehot = np.zeros((len(rows), n), dtype=np.float32)
    np.put_along_axis(onehot, rows, 1.0, axis=1)
    coact = onehot.T @ onehot
    np.fill_diagonal(coact, 0)
    perm = np.asarray(perms.get(block, np.arange(n)), dtype=np.int64)
    return coactivation_png(
        coact, perm, f"block {block}: co-activation over {len(rows):,} tokens, before and after"
    )


def _direct_alignment(path: Path) -> int:
    """The offset alignment O_DIRECT reads of ``path`` need (0 where O_DIRECT cannot open it)."""
    try:
        with open_file(path, Mode.DIRECT) as f:
            return f.offset_align
    except (ModeUnsupported, OSError):
        return 0


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


def _rows(
    model: MoeModel, block_map: list[int], costs: list[LayoutCost], replays: ReplaySet | None
) -> list[LayerRow]:
    """Per block; measured times from each replay's per-block share of its wall time."""
    rows = []
    for layer, b in enumerate(block_map):
        blk = model.block(b)
        measured: dict[str, float | None] = {}
        replay_pred: dict[str, float | None] = {}
        for r in replays.results if replays else []:
            measured[r.layout] = _us(r.block_time_per_token(b))
            p = r.block_predicted.get(b)
            replay_pred[r.layout] = None if p is None else p / r.tokens * 1e6
        rows.append(
            LayerRow(
                layer=layer,
                block=b,
                experts=blk.n_expert,
                slice_kib={t.name: t.slice_bytes / 1024 for t in blk.weight_tensors},
                requests={c.layout: c.block(b).requests_per_token for c in costs},
                bytes={c.layout: c.block(b).bytes_per_token for c in costs},
                predicted_us={c.layout: _us(c.block(b).time_per_token) for c in costs},
                measured_us=measured,
                replay_predicted_us=replay_pred,
            )
        )
    return rows
