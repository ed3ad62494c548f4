"""``moepack analyse``, ``advise`` and ``survey``: parsing and rendering only (the library is
``layout.analyse``, ``layout.advise`` and ``layout.survey``)."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from ..layout.advise import AdviseResult, advise
from ..layout.analyse import AnalyseOptions, AnalyseResult, analyse
from ..layout.cost import CostOptions
from ..layout.replay import MeasureOptions
from ..layout.survey import SurveyResult, survey
from ..storage.modes import Mode
from .flags import reword
from .options import (
    block_map_option,
    cost_depth_option,
    force_option,
    json_option,
    merge_gap_option,
    mode_choice,
    n_expert_option,
    path_in,
    path_out,
)
from .render import emit, human_bytes, notes, put, styled, table, warn


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _render_measured_layers(con: Console, r: AnalyseResult) -> None:
    """Per block: each layout's measured time per token beside the replay's prediction."""
    columns = ["block"]
    for name in r.layouts:
        columns += [f"{name} pred us", f"{name} meas us"]
    rows = []
    for row in r.rows:
        cells: list[object] = [row.block]
        for name in r.layouts:
            cells.append(_f(row.replay_predicted_us.get(name)))
            cells.append(_f(row.measured_us.get(name)))
        rows.append(cells)
    con.print(
        table(
            "per layer, replayed (us per token; measured: the block's share of the wall time)",
            columns,
            rows,
            right=set(range(len(columns))),
        )
    )


def _render(con: Console, r: AnalyseResult) -> None:
    put(
        con,
        styled(r.model, "bold"),
        f"  trace {r.trace or '-'}, tokens {r.tokens[0]}:{r.tokens[1]}, "
        f"queue depth {r.options.queue_depth}, cache {r.options.cache}, "
        f"merge gap {r.options.merge_gap}",
    )
    if r.fit:
        con.print(
            f"surface fit: time = requests x {r.fit.t_op * 1e6:.1f} us + bytes / "
            f"{r.fit.bandwidth / 1e9:.2f} GB/s"
        )
    timed = r.fit is not None
    columns = ["block", "experts", "slice KiB"]
    for name in r.layouts:
        columns += [f"{name} req/tok", f"{name} {'us/tok' if timed else 'bytes/tok'}"]
    columns += ["verdict"]
    rows = []
    for row in r.rows:
        cells: list[object] = [
            row.block,
            row.experts,
            "/".join(f"{k:.0f}" for k in row.slice_kib.values()),
        ]
        for name in r.layouts:
            cells.append(_f(row.requests[name], 2))
            cells.append(_f(row.predicted_us[name]) if timed else human_bytes(row.bytes[name]))
        cells.append(row.verdict)
        rows.append(cells)
    con.print(table("per layer", columns, rows, right=set(range(len(columns) - 1))))
    if r.replays:
        _render_measured_layers(con, r)
    if r.held_out is not None:
        h = r.held_out
        where = (
            f"the last {h.held_prompts} whole prompts"
            if h.by == "prompts"
            else f"tokens {r.tokens[0]}:{r.tokens[1]}"
        )
        con.print(f"judged on held-out {where}; the rest ({h.train_range[0]}:{h.train_range[1]}):")
        con.print(
            "  "
            + ", ".join(
                f"{name} {r.train_speedup(name) or 0:.3f}x there, {r.speedup(name):.3f}x held out"
                for name in r.layouts
                if name != "identity"
            )
        )
    summary = []
    for name in r.layouts:
        c = r.cost(name)
        ms = r.measured_speedup(name)
        rep = next((x for x in r.replays if x.layout == name), None)
        summary.append(
            [
                name,
                _f(c.requests_per_token, 2),
                human_bytes(c.bytes_per_token),
                _f(None if c.time_per_token is None else c.time_per_token * 1e6),
                "-" if rep is None else _f(rep.time_per_token * 1e6),
                f"{r.speedup(name):.3f}x",
                "-" if ms is None else f"{ms:.3f}x",
            ]
        )
    con.print(
        table(
            "summary (per token, all blocks)",
            [
                "layout",
                "requests",
                "bytes",
                "predicted us",
                "measured us",
                "speedup" if timed else "fewer requests",
                "measured speedup",
            ],
            summary,
            right={1, 2, 3, 4, 5, 6},
        )
    )
    notes(r.notes)
    notes([f"{rep.layout}: {note}" for rep in r.replays for note in rep.notes])
    if r.plot:
        con.print(f"wrote {r.plot}")
    if r.coact_plot:
        con.print(f"wrote {r.coact_plot}")


@click.command("analyse")
@click.argument("model", type=path_in)
@click.argument("trace", type=path_in)
@click.option("--surface", "surface_path", type=path_in, default=None, help="Bandwidth surface.")
@click.option(
    "--layouts",
    default=None,
    help="Comma-separated layouts (combine with +); default identity, pipeline, fused, "
    "expert-major (and reorder with --plan).",
)
@click.option("--plan", "plan_path", type=path_in, default=None, help="Plan for 'reorder'.")
@click.option(
    "--cache",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="LRU experts kept per block (0: every read cold).",
)
@merge_gap_option()
@cost_depth_option()
@click.option(
    "--tokens",
    "token_range",
    default=None,
    metavar="START:END",
    help="Token range to judge on (held-out tokens), e.g. 2048: .",
)
@click.option("--measure", is_flag=True, help="Replay the reads against the real file, cold.")
@click.option(
    "--measure-tokens",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Tokens replayed (the prediction then covers the same tokens).",
)
@click.option("--engine", default="pread", show_default=True, help="Read engine for --measure.")
@click.option(
    "--probe",
    is_flag=True,
    help="With --measure: measure the surface beside the replay, on the model file, at the "
    "request sizes it issues, and predict from that.",
)
@click.option(
    "--chunk-tokens",
    type=click.IntRange(min=0),
    default=16,
    show_default=True,
    help="With --measure: tokens per chunk; every layout reads each chunk in turn (0: one "
    "layout after the other).",
)
@click.option(
    "--holdout",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    default=None,
    help="Judge on this share of the tokens held out (the last whole prompts when the trace "
    "records several) and report the rest beside it.",
)
@click.option(
    "--coact-plot",
    "coact_plot",
    type=path_out,
    default=None,
    help="Write a PNG of the co-activation matrix before and after the plan's order.",
)
@click.option(
    "--mode",
    type=mode_choice(),
    default="direct",
    show_default=True,
    help="Cold reads: direct (O_DIRECT) or buffered with pages dropped.",
)
@click.option(
    "--plot",
    "plot_path",
    type=path_out,
    default=None,
    help="Write a PNG of per-layer speedup (and predicted vs measured).",
)
@n_expert_option("Expert count for text traces that lack one.")
@block_map_option
@json_option
@force_option
def analyse_cmd(
    model: Path,
    trace: Path,
    surface_path: Path | None,
    layouts: str | None,
    plan_path: Path | None,
    cache: int,
    merge_gap: int,
    queue_depth: int,
    token_range: str | None,
    measure: bool,
    measure_tokens: int,
    engine: str,
    probe: bool,
    chunk_tokens: int,
    holdout: float | None,
    coact_plot: Path | None,
    mode: str,
    plot_path: Path | None,
    n_expert: int | None,
    block_map: list[int] | None,
    as_json: bool,
) -> None:
    """Per layer: requests, bytes and read time per token under each layout, the speedup
    over the file as it is, and a verdict; with --measure, the reads replayed for real."""
    options = AnalyseOptions(
        layouts=tuple(x.strip() for x in layouts.split(",")) if layouts else None,
        cost=CostOptions(merge_gap, cache, queue_depth),
        token_range=token_range,
        holdout=holdout,
        measure=measure,
        measure_tokens=measure_tokens,
        replay=MeasureOptions(engine, Mode(mode), chunk_tokens, probe),
    )
    result = analyse(
        model,
        trace,
        options,
        plan=plan_path,
        surface=surface_path,
        n_expert=n_expert,
        block_map=block_map,
        plot=plot_path,
        coact_plot=coact_plot,
    )
    emit(result, as_json, _render)
    warn(result.warnings)


def _render_advice(con: Console, r: AdviseResult) -> None:
    for i, a in enumerate(r.advice, 1):
        con.print(styled(f"{i}. {a.title}", "bold"))
        con.print(f"   {a.detail}")
    notes(r.notes)


@click.command("advise")
@click.argument("model", type=path_in)
@click.argument("trace", type=path_in)
@click.option("--surface", "surface_path", type=path_in, default=None, help="Bandwidth surface.")
@cost_depth_option()
@n_expert_option("Expert count for text traces that lack one.")
@block_map_option
@json_option
def advise_cmd(
    model: Path,
    trace: Path,
    surface_path: Path | None,
    queue_depth: int,
    n_expert: int | None,
    block_map: list[int] | None,
    as_json: bool,
) -> None:
    """Ranked recommendations (leave alone, reorder, fuse, expert-major store; queue depth;
    cache size), each with its numbers, judged on the trace's second half."""
    result = advise(model, trace, surface_path, queue_depth, n_expert, block_map)
    emit(result, as_json, _render_advice)
    warn(result.warnings)


def _render_survey(con: Console, r: SurveyResult) -> None:
    if r.fit:
        con.print(f"surface fit: t_op {r.fit.t_op * 1e6:.1f} us, {r.fit.bandwidth / 1e9:.2f} GB/s")
    rows = [
        [
            x.name,
            x.hidden,
            x.expert_ffn,
            f"{x.experts}/top-{x.top_k}",
            x.moe_layers,
            f"{x.slice_bytes / 1024:,.0f}",
            human_bytes(x.bytes_per_token),
            reword(x.verdict),
        ]
        for x in r.rows
    ]
    con.print(
        table(
            f"expert slices at {r.rows[0].bits:g} bits/weight" if r.rows else "expert slices",
            [
                "family",
                "hidden",
                "expert ffn",
                "experts",
                "MoE layers",
                "slice KiB",
                "read/token",
                "verdict",
            ],
            rows,
            right={1, 2, 4, 5, 6},
        )
    )
    for x in r.rows:
        con.print(f"{x.name}: {x.source}")
    notes(r.notes)


@click.command("survey")
@click.argument("configs", nargs=-1, type=path_in)
@click.option("--known", is_flag=True, help="Add the built-in table of well-known MoE families.")
@click.option("--bits", type=float, default=4.5, show_default=True, help="Bits per weight.")
@click.option("--surface", "surface_path", type=path_in, default=None, help="Bandwidth surface.")
@cost_depth_option()
@json_option
def survey_cmd(
    configs: tuple[Path, ...],
    known: bool,
    bits: float,
    surface_path: Path | None,
    queue_depth: int,
    as_json: bool,
) -> None:
    """From Hugging Face config.json files alone: per-expert slice sizes, and whether layout
    can matter on the surface's device."""
    result = survey(list(configs), known, bits, surface_path, queue_depth)
    emit(result, as_json, _render_survey)
