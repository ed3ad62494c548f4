"""``moepack replay`` and ``moepack predict``: parsing and rendering only (the library is
``stream.command.replay_command`` and ``stream.forecast.predict``)."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from ..storage.modes import Mode
from ..stream.budget import CacheBudget
from ..stream.command import ReplayReport, replay_command
from ..stream.forecast import PredictResult, predict
from ..stream.replay import ReplayOptions
from ..trace.cache_policy import POLICIES
from .options import (
    ListType,
    SizeType,
    block_map_option,
    engine_options,
    force_option,
    json_option,
    model_option,
    n_expert_option,
    path_in,
    path_out,
    quiet_option,
)
from .render import RichProgress, emit, human_bytes, notes, put, styled, table, warn


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f} %"


def _render(con: Console, report: ReplayReport) -> None:
    r = report.replay
    put(
        con,
        styled(r.source, "bold"),
        f" ({r.kind}, layout {r.layout})  trace {r.trace}, "
        f"{r.tokens} tokens, policy {r.policy}, cache {human_bytes(r.cache_bytes)} "
        f"({min(r.slots)}-{max(r.slots)} slots/layer)",
    )
    rows = [
        ["hit rate, all tokens", _pct(r.rates.lifetime)],
        ["hit rate, decode tokens", _pct(r.rates.decode)],
        ["bytes read / token", human_bytes(r.bytes_per_token)],
        ["requests / token", f"{r.requests_per_token:.2f}"],
        ["achieved bandwidth", f"{r.gbps:.3f} GB/s"],
        ["I/O time / token", f"{r.io_seconds_per_token * 1e6:.1f} us"],
        [
            "fetch-limited tokens/s",
            "-" if r.tokens_per_second_bound is None else f"{r.tokens_per_second_bound:.1f}",
        ],
        ["read path", f"{r.engine}, {r.mode}, queue depth {r.queue_depth}"],
        ["peak RSS", human_bytes(r.peak_rss)],
    ]
    if r.prefetch:
        p = r.prefetch
        rows += [
            ["prefetch", f"{p.predictor}, {p.budget} experts/layer"],
            ["prefetch precision", _pct(p.precision)],
            ["prefetch usefulness (misses covered)", _pct(p.usefulness)],
        ]
    con.print(table("replay (measured)", ["", "value"], rows, right={1}))
    if report.sweep:
        sweep_rows = [
            [
                p.policy,
                p.slots,
                human_bytes(p.cache_bytes),
                _pct(p.rates.lifetime),
                _pct(p.rates.decode),
                human_bytes(p.bytes_per_token),
                "-" if p.tokens_per_second is None else f"{p.tokens_per_second:.1f}",
            ]
            for p in report.sweep
        ]
        con.print(
            table(
                "sweep (simulated hit rates; tokens/s at the measured GB/s)",
                ["policy", "slots", "cache", "hit all", "hit decode", "read/token", "tok/s"],
                sweep_rows,
                right={1, 2, 3, 4, 5, 6},
            )
        )
    notes(r.notes)
    if report.plot:
        con.print(f"wrote {report.plot}")


@click.command("replay")
@click.argument("source", type=path_in)
@click.argument("trace", type=path_in)
@click.option(
    "--cache",
    "cache_bytes",
    type=SizeType(),
    default=None,
    help="Cache budget in bytes (all layers).",
)
@click.option(
    "--slots", type=click.IntRange(min=1), default=None, help="Cache budget in slots per layer."
)
@click.option(
    "--policy",
    default="lru",
    show_default=True,
    help=f"Cache policy: {', '.join(POLICIES.names())}.",
)
@engine_options("Read engine (moepack engines).", "Reads in flight.")
@click.option(
    "--mode",
    type=click.Choice(["direct", "buffered"]),
    default="direct",
    show_default=True,
    help="Cold reads: direct (O_DIRECT) or buffered with pages dropped.",
)
@click.option(
    "--prefetch",
    "predictor",
    default=None,
    help="Predictor whose experts are read ahead (combine with +).",
)
@click.option(
    "--prefetch-budget",
    type=click.IntRange(min=1),
    default=None,
    help="Experts read ahead per token and layer (default top-k).",
)
@click.option(
    "--layout",
    default="identity",
    show_default=True,
    help="GGUF source: the layout whose offsets are read.",
)
@click.option(
    "--plan", "plan_path", type=path_in, default=None, help="Plan for a 'reorder' layout."
)
@click.option(
    "--tokens",
    "token_range",
    default=None,
    metavar="START:END",
    help="Replay only these tokens (from an empty cache).",
)
@click.option(
    "--holdout",
    "holdout_prompts",
    is_flag=True,
    help="Replay the last quarter of the prompts only; pinned sets and the predictor learn "
    "from the others.",
)
@click.option(
    "--sweep",
    "sweep_policies",
    type=ListType("str"),
    metavar="POLICIES",
    default=None,
    help="Policies to sweep over cache sizes ('all' for every one).",
)
@click.option(
    "--sweep-slots",
    type=ListType("int"),
    metavar="SLOTS",
    default=None,
    help="Sweep sizes in slots per layer (default top-k .. experts).",
)
@click.option("--plot", "plot_path", type=path_out, default=None, help="PNG of the sweep.")
@n_expert_option("Expert count for text traces that lack one.")
@block_map_option
@json_option
@quiet_option
@force_option
def replay_cmd(
    source: Path,
    trace: Path,
    cache_bytes: int | None,
    slots: int | None,
    policy: str,
    engine: str,
    queue_depth: int,
    mode: str,
    predictor: str | None,
    prefetch_budget: int | None,
    layout: str,
    plan_path: Path | None,
    token_range: str | None,
    holdout_prompts: bool,
    sweep_policies: list[str] | None,
    sweep_slots: list[int] | None,
    plot_path: Path | None,
    n_expert: int | None,
    block_map: list[int] | None,
    as_json: bool,
    quiet: bool,
) -> None:
    """Replay TRACE's experts through an expert cache, reading every miss for real and cold
    from SOURCE (an expert-major store, or a GGUF at a layout's offsets): hit rates, bytes and time per token, achieved
    GB/s, the fetch-limited tokens/s, prefetch precision, peak RSS; --sweep plots cache sizes."""
    if sweep_policies == ["all"]:
        sweep_policies = POLICIES.names()
    if plot_path is not None and not sweep_policies:
        raise click.UsageError("--plot draws the sweep: give --sweep too")
    report = replay_command(
        source,
        trace,
        ReplayOptions(
            CacheBudget(cache_bytes, slots),
            policy,
            engine,
            queue_depth,
            Mode(mode),
            predictor,
            prefetch_budget,
        ),
        layout=layout,
        plan_path=plan_path,
        token_range=token_range,
        holdout_prompts=holdout_prompts,
        sweep_policies=sweep_policies,
        sweep_sizes=sweep_slots,
        plot=plot_path,
        n_expert=n_expert,
        block_map=block_map,
        progress=RichProgress(not quiet and not as_json),
    )
    emit(report, as_json, _render)
    warn(report.notes)  # inputs bound by shape only


def _render_predict(con: Console, r: PredictResult) -> None:
    s = r.split
    put(
        con,
        styled(r.trace, "bold"),
        f"  top-{r.k}; fitted on {s.train_rows.size} tokens, scored on "
        f"{s.eval_rows.size} held-out tokens"
        + (f" ({s.eval_prompts} whole prompts)" if s.by_prompts else ""),
    )
    rows = [
        [
            x.predictor,
            x.budget,
            _pct(x.recall),
            _pct(x.precision),
            _pct(x.decode_recall),
            _pct(x.decode_precision),
        ]
        for x in r.scores
    ]
    con.print(
        table(
            "held-out prediction of each token's experts",
            ["predictor", "budget", "recall", "precision", "decode recall", "decode precision"],
            rows,
            right={1, 2, 3, 4, 5},
        )
    )
    notes(r.notes)


@click.command("predict")
@click.argument("trace", type=path_in)
@click.option(
    "--predictors",
    type=ListType("str"),
    default=None,
    help="Predictors (combine with +); default all and sticky+markov, sticky+cross-layer.",
)
@click.option(
    "--budgets",
    type=ListType("int"),
    default=None,
    help="Fetch budgets in experts per layer (default k and 2k).",
)
@model_option
@n_expert_option("Expert count for text traces that lack one.")
@json_option
def predict_cmd(
    trace: Path,
    predictors: list[str] | None,
    budgets: list[int] | None,
    model_path: Path | None,
    n_expert: int | None,
    as_json: bool,
) -> None:
    """Recall and precision of each predictor of the next token's experts at a fetch budget,
    fitted on the trace's first prompts and scored on whole prompts held out."""
    result = predict(trace, predictors, budgets, model_path=model_path, n_expert=n_expert)
    emit(result, as_json, _render_predict)
    warn(result.warnings)
