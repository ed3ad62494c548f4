"""``moepack trace stats``: parsing and rendering only (the library is ``trace.routing_stats``)."""

from __future__ import annotations

import math
from pathlib import Path

import click
from rich.console import Console

from ..trace.routing_stats import MAX_LAG, PhaseRoutingStats, TraceStatsResult, trace_stats
from .hints import STATS_HINTS, hints
from .options import (
    DETECTED,
    N_EXPERT_HELP,
    count_option,
    folder_path,
    force_option,
    json_option,
    model_option,
    n_expert_option,
    path_in,
    quiet_option,
    trace_format_option,
)
from .render import RichProgress, emit, put, styled, table, warn


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _cache_sizes(k: int, n: int) -> list[int]:
    """The cache sizes the table shows: k, 2k, 4k, n/4, n/2 (those within 1..n, once each)."""
    return sorted({c for c in (k, 2 * k, 4 * k, n // 4, n // 2) if 1 <= c <= n})


def _render_phase(con: Console, ph: PhaseRoutingStats, k: int, n: int) -> None:
    sizes = _cache_sizes(k, n)
    columns = [
        "layer",
        "block",
        "entropy",
        "hot 10%",
        "90% in",
        "reuse@1",
        f"reuse@{MAX_LAG}",
        "lift>2x",
        "lift p99",
        "next: MI bits",
        "next: best map (const)",
        *[f"LRU@{c}" for c in sizes],
    ]
    rows = [
        [
            s.layer,
            "-" if s.block is None else s.block,
            _f(s.entropy),
            _f(s.hot10_share),
            s.experts_for["90%"],
            _f(s.reuse[0]),
            _f(s.reuse[-1]),
            _f(s.lift_above_2x),
            _f(s.lift_p99, 2),
            _f(s.next_mi_bits),
            "-" if s.next_best_map is None else f"{_f(s.next_best_map)} ({_f(s.next_baseline)})",
            *[_f(s.lru_hit_rate[c - 1]) for c in sizes],
        ]
        for s in ph.layers
    ]
    title = f"{ph.phase} tokens ({ph.tokens:,})"
    con.print(table(title, columns, rows, right=set(range(len(columns)))))


def _render(con: Console, r: TraceStatsResult) -> None:
    s = r.stats.summary
    prompts = f" in {s['prompts']} prompts" if s.get("prompts", 1) > 1 else ""
    put(
        con,
        styled(s["path"], "bold"),
        f"  {r.format}, {s['tokens']:,} tokens "
        f"({s['prefill_tokens']:,} prefill{prompts}), {s['layers']} layers, top-{s['k']} of "
        f"{s['n_expert']} experts",
    )
    for ph in r.stats.phases.values():
        _render_phase(con, ph, s["k"], s["n_expert"])
    con.print(
        f"entropy 1.000 = uniform; independent uniform routing reuses {r.stats.random_reuse:.3f} "
        "of the experts at any lag and has lift 1; 'best map' is how often an expert's most "
        "frequent follower is chosen at the next layer, '(const)' the next layer's most popular "
        "expert alone; LRU@C: exact hit rate of an LRU cache of C experts per layer"
    )
    for note in r.stats.notes:
        con.print(f"note: {note}")
    for p in r.plots:
        con.print(f"wrote {p}")


@click.command("stats")
@click.argument("trace", type=path_in)
@trace_format_option("--format", "fmt", DETECTED)
@n_expert_option(N_EXPERT_HELP)
@model_option
@click.option(
    "--plot",
    "plot_dir",
    type=folder_path,
    default=None,
    help="Write popularity, reuse, LRU hit-rate and co-activation PNGs into this folder.",
)
@count_option("--heatmap-layer", 0, "Trace layer of the co-activation heatmap.", low=0)
@json_option
@quiet_option
@force_option
def stats_cmd(
    trace: Path,
    fmt: str | None,
    n_expert: int | None,
    model_path: Path | None,
    plot_dir: Path | None,
    heatmap_layer: int,
    as_json: bool,
    quiet: bool,
) -> None:
    """Popularity, reuse, co-activation lift, layer-to-layer predictability and the exact
    LRU hit-rate curve of TRACE, per layer, for all tokens and for decode tokens."""
    progress = RichProgress(enabled=not quiet)
    with hints(STATS_HINTS):
        result = trace_stats(
            trace,
            format=fmt,
            n_expert=n_expert,
            model=model_path,
            plot_dir=plot_dir,
            heatmap_layer=heatmap_layer,
            progress=progress,
        )
    emit(result, as_json, _render)
    warn(result.warnings)
