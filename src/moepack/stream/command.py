"""``moepack replay`` as one library call: open the source (a GGUF, or an expert-major
store), bind the trace to it, replay with real reads, and optionally sweep cache sizes."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..binding import shape_only_warning
from ..checkpoint.model import MoeModel
from ..errors import BadInput
from ..filekinds import IMAGE, check_output_kind
from ..inputs import regular_file
from ..layout.plan import load_plan
from ..progress import NULL_PROGRESS, ProgressSink
from ..safeio import check_destination, os_error_text
from ..store import ExpertStore, open_store
from ..token_range import parse_token_range
from ..trace.cache_policy import POLICIES
from ..trace.core import RoutingTrace
from ..trace.formats import load_trace
from .forecast import holdout
from .replay import ReplayOptions, StreamReplayResult, replay
from .sources import ExpertFile, gguf_source, store_source
from .sweep import SweepPoint, default_sizes, sweep

GGUF_MAGIC = b"GGUF"


@dataclass
class ReplayReport:
    """One replay, and the sweep of cache sizes when asked for."""

    replay: StreamReplayResult
    sweep: list[SweepPoint] = field(default_factory=list)
    plot: Path | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            **self.replay.to_json(),
            "warnings": list(self.notes),
            "sweep": [p.to_json() for p in self.sweep],
            "plot": None if self.plot is None else str(self.plot),
        }


def is_gguf(path: Path) -> bool:
    """Whether ``path`` starts with the GGUF magic; checked to be a regular file first, since
    opening a FIFO to sniff it would block forever."""
    regular_file(path, "model or expert store")
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError as e:
        raise BadInput(f"cannot read it: {os_error_text(e)}", path) from None


def _bind(trace: RoutingTrace, model: MoeModel, block_map: list[int] | None) -> RoutingTrace:
    if block_map is not None:
        trace = trace.replace(block_map=list(block_map))
    return trace.bound_to(model)


def _bind_store(
    trace: RoutingTrace, store: ExpertStore, block_map: list[int] | None
) -> RoutingTrace:
    """``trace`` checked against a store: the model's fingerprint when the trace records
    one, every trace layer a block the store holds, the expert counts."""
    where = trace.path
    if trace.model_fingerprint is not None and trace.model_fingerprint != store.fingerprint:
        raise BadInput(
            f"trace belongs to the model with fingerprint {trace.model_fingerprint}, but the "
            f"store {store.path} was built from {store.fingerprint} (another model)",
            where,
        )
    blocks = list(block_map) if block_map is not None else trace.block_map
    if blocks is None:
        if trace.layers != len(store.blocks):
            raise BadInput(
                f"trace has {trace.layers} layers but the store holds {len(store.blocks)} MoE "
                "blocks; give `block_map`",
                where,
            )
        blocks = list(store.blocks)
    if len(blocks) != trace.layers:
        raise BadInput(f"block map names {len(blocks)} blocks for {trace.layers} layers", where)
    for layer, b in enumerate(blocks):
        n = len(store.experts(b))
        if n != trace.n_expert or int(trace.layer_max[layer]) >= n:
            raise BadInput(
                f"trace layer {layer} routes among {trace.n_expert} experts but store block {b} "
                f"holds {n}",
                where,
            )
    return trace.replace(block_map=blocks)


def replay_command(
    source: str | os.PathLike[str],
    trace_path: str | os.PathLike[str],
    options: ReplayOptions,
    *,
    layout: str = "identity",
    plan_path: str | os.PathLike[str] | None = None,
    token_range: str | None = None,
    holdout_prompts: bool = False,
    sweep_policies: list[str] | None = None,
    sweep_sizes: list[int] | None = None,
    plot: str | os.PathLike[str] | None = None,
    n_expert: int | None = None,
    block_map: list[int] | None = None,
    progress: ProgressSink = NULL_PROGRESS,
) -> ReplayReport:
    """Replay ``trace_path`` from ``source`` (a GGUF, else an expert-major store) under ``options``; with
    ``sweep_policies``, also every policy at every size of ``sweep_sizes`` (slots per layer),
    plotted to ``plot``. ``holdout_prompts``: replay the last quarter of the prompts only,
    pinned sets and the predictor learned from the others."""
    path = Path(source)
    if plot is not None:  # refused before the replay, not after it
        check_destination(check_output_kind(plot, IMAGE), [source, trace_path])
    notes: list[str] = []
    sweep_args = (sweep_policies, sweep_sizes, plot)
    rows = (token_range, holdout_prompts)
    if not is_gguf(path):
        if layout != "identity" or plan_path is not None:
            raise BadInput("`layout` and `plan_path` apply to a GGUF source, not a store", path)
        with open_store(path) as store:
            hint = n_expert or (store.n_expert if store.n_expert > 0 else None)
            trace = _bind_store(load_trace(trace_path, n_expert=hint), store, block_map)
            if trace.model_fingerprint is None:
                notes.append(shape_only_warning("trace", trace_path, path))
            src = store_source(store, trace.block_map or [])
            return _run(trace, src, options, rows, sweep_args, notes, progress)
    with MoeModel(path) as model:
        raw = load_trace(trace_path, n_expert=n_expert, model=model, check=False)
        if raw.model_fingerprint is None:
            notes.append(shape_only_warning("trace", trace_path, path))
        trace = _bind(raw, model, block_map)
        plan = load_plan(plan_path) if plan_path is not None else None
        if plan is not None and plan.model_fingerprint is None:
            notes.append(shape_only_warning("plan", plan_path, path))
        src = gguf_source(model, trace.block_map or [], layout, plan)
        return _run(trace, src, options, rows, sweep_args, notes, progress)


def _run(
    trace: RoutingTrace,
    src: ExpertFile,
    options: ReplayOptions,
    rows_args: tuple[str | None, bool],
    sweep_args: tuple[list[str] | None, list[int] | None, str | os.PathLike[str] | None],
    notes: list[str],
    progress: ProgressSink,
) -> ReplayReport:
    sweep_policies, sweep_sizes, plot = sweep_args
    token_range, holdout_prompts = rows_args
    fit_rows = None
    if holdout_prompts:
        if token_range is not None:
            raise BadInput(
                "`holdout_prompts` chooses the replayed tokens itself: drop `token_range`"
            )
        split = holdout(trace)
        if not split.by_prompts:
            raise BadInput(
                "`holdout_prompts` needs a trace of several prompts (this one records one)",
                trace.path,
            )
        rows = (int(split.eval_rows[0]), int(split.eval_rows[-1]) + 1)
        fit_rows = split.train_rows
    else:
        rows = parse_token_range(token_range, trace.tokens)
    sizes = sweep_sizes or default_sizes(trace.k, trace.n_expert)
    if sweep_policies:
        for name in sweep_policies:
            POLICIES.get(name)
        bad = [s for s in sizes if s < trace.k or s > trace.n_expert]
        if bad:
            raise BadInput(
                f"sweep size {bad[0]} slots per layer is outside top-k {trace.k} .. "
                f"{trace.n_expert} experts"
            )
    result = replay(trace, src, options, rows, progress, fit_rows)
    report = ReplayReport(result, notes=notes)
    if sweep_policies:
        bw = result.device_bytes / result.seconds if result.seconds > 0 else None
        eb = [src.expert_bytes(i) for i in range(trace.layers)]
        report.sweep = sweep(trace, eb, sweep_policies, sizes, bw, rows, progress, fit_rows)
        if plot is not None:
            from .sweep_plot import write_sweep_png  # matplotlib only when plotting

            title = f"{Path(src.label).name} + {Path(trace.label()).name}"
            report.plot = write_sweep_png(report.sweep, title, Path(plot))
    return report
