"""``plan --out [--map]``: plan from files and write the plan, and its co-activation map when
asked for, as one group (both appear or neither)."""

from __future__ import annotations

from pathlib import Path

from ..errors import BadInput
from ..filekinds import IMAGE, PLAN, check_output_kind
from ..outputs import write_together
from ..safeio import check_destination, real
from .coactivation_plan import PlanOutcome, plan_files
from .plan import encode_plan
from .planner import PlannerResult, SearchOptions, plan_model


def write_plan_files(
    model_path: Path,
    trace_path: Path,
    out: Path,
    *,
    map_path: Path | None = None,
    map_block: int | None = None,
    phase: str = "all",
    holdout: float | None = None,
    order_groups: bool = True,
    n_expert: int | None = None,
    block_map: list[int] | None = None,
) -> PlanOutcome:
    """Plan ``model_path``'s expert order from ``trace_path`` and write it to ``out`` (its
    format from the extension) and, with ``map_path``, the map PNG. The destinations are
    checked before any planning."""
    inputs = [model_path, trace_path]
    _check_outputs(out, map_path, inputs)
    outcome = plan_files(
        model_path,
        trace_path,
        n_expert=n_expert,
        phase=phase,
        draw_map=map_path is not None,
        map_block=map_block,
        block_map=block_map,
        order_groups=order_groups,
        holdout=holdout,
    )
    files = [(out, encode_plan(outcome.plan, out))]
    if map_path is not None and outcome.map_png is not None:
        files.append((map_path, outcome.map_png))
    write_together(files, inputs)
    return outcome


def write_searched_plan(
    model_path: Path,
    trace_path: Path,
    out: Path,
    options: SearchOptions | None = None,
    *,
    surface_path: Path | None = None,
    n_expert: int | None = None,
    block_map: list[int] | None = None,
    map_path: Path | None = None,
    map_block: int | None = None,
) -> PlannerResult:
    """``plan --search``: the planner of ``planner.plan_model`` (seriation + local search on the
    cost model, judged on held-out tokens, as ``options`` say), its plan written to ``out``
    and, with ``map_path``, the co-activation map of ``map_block`` (default: the block whose
    held-out cost the plan cuts most), both as one group."""
    from ..checkpoint.model import MoeModel
    from ..storage.surface import Surface
    from ..trace.formats import load_trace
    from .coactivation_plan import order_map_png

    inputs = [model_path, trace_path]
    _check_outputs(out, map_path, inputs)
    surface = Surface.load(surface_path) if surface_path is not None else None
    with MoeModel(model_path) as model:
        trace = load_trace(trace_path, n_expert=n_expert, model=model, check=False)
        if block_map is not None:
            trace = trace.replace(block_map=block_map)
        result = plan_model(model, trace, options, surface=surface)
        files = [(out, encode_plan(result.plan, out))]
        if map_path is not None:
            if map_block is None:
                map_block = max(result.blocks, key=lambda b: b.held_gain).block
            blocks = trace.check_against(model)
            files.append((map_path, order_map_png(trace, blocks, result.plan, map_block)))
            result.map_block = map_block
    write_together(files, inputs)
    return result


def _check_outputs(out: Path, map_path: Path | None, inputs: list[Path]) -> None:
    """The plan's and the map's destinations, before any planning."""
    if map_path is not None and real(map_path) == real(out):
        raise BadInput("`out` and `map_path` name the same file", map_path)
    check_destination(out, inputs)
    check_output_kind(out, PLAN)
    if map_path is not None:
        check_destination(map_path, inputs)
        check_output_kind(map_path, IMAGE)
