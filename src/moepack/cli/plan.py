"""``moepack plan`` and ``plan --search``: parsing and rendering only (the library is
``layout.plan_output``)."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from ..layout.coactivation_plan import PlanOutcome
from ..layout.plan_output import write_plan_files, write_searched_plan
from ..layout.planner import PlannerResult, SearchOptions
from .hints import PLAN_HINTS, hints
from .options import (
    block_map_option,
    cost_depth_option,
    force_option,
    input_path,
    json_option,
    merge_gap_option,
    n_expert_option,
    out_option,
    path_out,
)
from .render import emit, stdout, table, warn


def _render_plan(con: Console, r: PlanOutcome) -> None:
    rows = [
        [
            x.block,
            f"{x.requests_before:.2f}",
            f"{x.requests_after:.2f}",
            f"{x.speedup:.3f}x",
            "reorder" if x.changed else "leave alone",
        ]
        for x in r.layers
    ]
    con.print(
        table(
            f"Plan from {r.trace_tokens:,} tokens ({r.phase}): read requests per token",
            ["block", "before", "after", "fewer by", "verdict"],
            rows,
            right={0, 1, 2, 3},
        )
    )
    before, after = r.requests_before, r.requests_after
    con.print(
        f"all MoE blocks: {before:.2f} -> {after:.2f} requests per token ({before / after if after else 1:.3f}x)"
    )
    h = r.held_out
    if h is not None:
        part = (
            f"the {h['held_out_prompts']} held-out prompts"
            if h["by"] == "prompts"
            else f"held-out tokens {h['held_out_tokens'][0]}:{h['held_out_tokens'][1]}"
        )
        con.print(
            f"on {part}: {h['requests_before']:.2f} -> {h['requests_after']:.2f} requests per "
            f"token ({h['held_out_gain']:.3f}x; on the planning part {h['train_gain']:.3f}x, "
            f"gap {h['gap']:+.3f})"
        )


def _held_out_words(r: PlannerResult) -> str:
    h = r.held_out
    if h is not None and h.by == "prompts":
        return (
            f"trained on {h.train_prompts} prompts (tokens {r.train_tokens[0]}:"
            f"{r.train_tokens[1]}), judged on the {h.held_prompts} held-out prompts after them"
        )
    return (
        f"trained on tokens {r.train_tokens[0]}:{r.train_tokens[1]}, judged on "
        f"{r.held_tokens[0]}:{r.held_tokens[1]}"
    )


def _render_search(con: Console, r: PlannerResult) -> None:
    rows = [
        [
            b.block,
            b.candidate,
            f"{b.train_gain:.3f}x",
            f"{b.held_gain:.3f}x",
            f"{b.chain_held_gain:.3f}x",
            b.left_alone or "reordered",
        ]
        for b in r.blocks
    ]
    con.print(
        table(
            f"plan (objective: {'modelled read time' if r.timed else 'requests'} at queue depth "
            f"{r.queue_depth}; {_held_out_words(r)})",
            ["block", "won", "train gain", "held-out gain", "plan's chain", "outcome"],
            rows,
            right={2, 3, 4},
        )
    )
    won = ", ".join(f"{way} {n}" for way, n in sorted(r.won().items()))
    con.print(
        f"held-out gain {r.gain('held'):.3f}x (train {r.gain('train'):.3f}x, gap "
        f"{r.gain('train') - r.gain('held'):+.3f}); plan's chain {r.chain_gain('held'):.3f}x "
        f"held-out; blocks won on the training tokens: {won}"
    )
    for note in r.notes:
        con.print(f"note: {note}")


@click.command("plan")
@click.argument("model", type=input_path)
@click.option(
    "--trace",
    "trace_path",
    required=True,
    type=input_path,
    help="Routing trace (any supported format).",
)
@out_option("Plan to write (.moeplan, or .pmxplan for the peer).")
@n_expert_option("Expert count for text traces that lack one.")
@click.option(
    "--phase", type=click.Choice(["all", "prefill", "decode"]), default="all", show_default=True
)
@click.option(
    "--map",
    "map_path",
    type=path_out,
    default=None,
    help="Also draw a co-activation map (PNG): before and after the plan.",
)
@click.option(
    "--map-block", type=int, default=None, help="Block for --map (default: the most improved)."
)
@block_map_option
@click.option(
    "--keep-group-order",
    is_flag=True,
    help="In models with routing groups, reorder experts only within each group (by default "
    "whole groups are ordered too).",
)
@click.option(
    "--search",
    is_flag=True,
    help="Seriation + local search on the cost model's read time, judged on held-out tokens.",
)
@click.option(
    "--surface",
    "surface_path",
    type=input_path,
    default=None,
    help="With --search: bandwidth surface (the objective becomes read time).",
)
@click.option(
    "--holdout",
    type=float,
    default=None,
    help="Share of the tokens kept to judge the plan (the last whole prompts when the trace "
    "records several, else the last tokens); the plan is made on the rest. Default with "
    "--search: 0.25; without it, no tokens are held out.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="With --search: seed.")
@click.option(
    "--engine",
    default=None,
    help="With --search: the read engine the model will be served with (checked against the "
    "queue depth and the surface's engine).",
)
@cost_depth_option("With --search: reads in flight; the cost model times requests at this depth.")
@merge_gap_option("With --search: read through gaps of up to this many slices when cheaper.")
@json_option
@force_option
def plan_cmd(
    model: Path,
    trace_path: Path,
    out: Path,
    n_expert: int | None,
    phase: str,
    map_path: Path | None,
    map_block: int | None,
    block_map: list[int] | None,
    keep_group_order: bool,
    search: bool,
    surface_path: Path | None,
    holdout: float | None,
    seed: int,
    engine: str | None,
    queue_depth: int,
    merge_gap: int,
    as_json: bool,
) -> None:
    """Order each MoE block's experts so that experts chosen together sit together."""
    if search:
        with hints(PLAN_HINTS):
            options = SearchOptions(
                queue_depth=queue_depth,
                engine=engine,
                merge_gap=merge_gap,
                holdout=0.25 if holdout is None else holdout,
                seed=seed,
                order_groups=not keep_group_order,
            )
            result = write_searched_plan(
                model,
                trace_path,
                out,
                options,
                surface_path=surface_path,
                n_expert=n_expert,
                block_map=block_map,
                map_path=map_path,
                map_block=map_block,
            )
        emit(result, as_json, _render_search)
        if not as_json:
            stdout.print(f"wrote {out}")
            if map_path is not None:
                stdout.print(f"wrote {map_path} (co-activation map of block {result.map_block})")
        return
    with hints(PLAN_HINTS):
        outcome = write_plan_files(
            model,
            trace_path,
            out,
            map_path=map_path,
            n_expert=n_expert,
            phase=phase,
            map_block=map_block,
            block_map=block_map,
            order_groups=not keep_group_order,
            holdout=holdout,
        )
    warn(outcome.warnings)
    emit(outcome, as_json, _render_plan)
    if not as_json:
        stdout.print(f"wrote {out}")
        if map_path is not None:
            stdout.print(f"wrote {map_path} (co-activation map of block {outcome.map_block})")
