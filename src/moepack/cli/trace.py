"""``moepack trace info | convert | synth | formats``: parsing and rendering only (the library is
``trace.info``, ``trace.convert``, ``trace.synthfile`` and ``trace.listing``)."""

from __future__ import annotations

import math
from pathlib import Path

import click
from rich.console import Console

from ..blocklist import format_index_list
from ..trace.convert import ConvertResult, trace_convert
from ..trace.formats import SaveResult
from ..trace.info import TraceInfo, trace_info
from ..trace.listing import FormatRow, list_formats
from ..trace.synth import TraceStructure
from ..trace.synthfile import SynthTraceResult, write_synth_trace
from .hints import CONVERT_HINTS, INFO_HINTS, SYNTH_HINTS, hints
from .options import (
    DETECTED,
    N_EXPERT_HELP,
    block_map_option,
    count_option,
    force_option,
    fraction_option,
    json_option,
    model_option,
    n_expert_option,
    path_in,
    path_out,
    pmx_version_option,
    quiet_option,
    seed_option,
    to_format_option,
    trace_format_option,
)
from .render import RichProgress, emit, human_bytes, put, styled, table, warn


def _fmt(x: float, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


# ------------------------------------------------------------------ info
def _render_info(con: Console, r: TraceInfo) -> None:
    s = r.stats.summary
    prov = s.get("provenance") or {}
    put(con, styled(s["path"], "bold"), f"  ({r.format}, {human_bytes(r.file_bytes)})")
    bm = s["block_map"]
    rows = [
        [
            "tokens",
            f"{s['tokens']:,} ({s['prefill_tokens']:,} prefill, {s['decode_tokens']:,} decode"
            + (f", {s['prompts']} prompts)" if s.get("prompts", 1) > 1 else ")"),
        ],
        ["layers x top-k", f"{s['layers']} x {s['k']} of {s['n_expert']} experts"],
        ["router weights", "yes" if s["weights"] else "no"],
        [
            "block map",
            format_index_list(bm, ", ") if bm is not None else "not recorded (i-th MoE block)",
        ],
        ["model fingerprint", s["model_fingerprint"] or "not recorded"],
    ]
    for key in ("source", "model", "created"):
        if prov.get(key):
            rows.append([key, str(prov[key])])
    for note in prov.get("notes", []) or []:
        rows.append(["note", str(note)])
    b = r.stats.binding
    if b is not None:
        fp = {True: "fingerprint matches", None: "no fingerprint in the trace"}.get(
            b["fingerprint_matches"], ""
        )
        rows.append(
            ["fits model", f"{b['model']} ({fp}; blocks {format_index_list(b['blocks'], ', ')})"]
        )
    con.print(table(None, ["trace", "value"], rows))
    lag, win = r.stats.lag, r.stats.window
    layer_rows = [
        [
            x.layer,
            "-" if x.block is None else x.block,
            x.distinct,
            _fmt(x.window_distinct, 1),
            _fmt(x.entropy),
            _fmt(x.hot_recall),
            _fmt(x.overlap),
            _fmt(x.overlap_lag),
        ]
        for x in r.stats.layers
    ]
    con.print(
        table(
            "per layer",
            [
                "layer",
                "block",
                "experts used",
                f"per {win} tok",
                "entropy",
                "hot-k recall",
                "overlap lag 1",
                f"lag {lag}",
            ],
            layer_rows,
            right=set(range(8)),
        )
    )
    if r.stats.phases:
        con.print(
            table(
                "per phase (means over layers)",
                [
                    "phase",
                    "tokens",
                    "experts used",
                    "entropy",
                    "hot-k recall",
                    "overlap lag 1",
                    f"lag {lag}",
                ],
                [
                    [
                        name,
                        f"{p.tokens:,}",
                        _fmt(p.distinct, 1),
                        _fmt(p.entropy),
                        _fmt(p.hot_recall),
                        _fmt(p.overlap),
                        _fmt(p.overlap_lag),
                    ]
                    for name, p in r.stats.phases.items()
                ],
                right=set(range(1, 7)),
            )
        )
    for note in r.stats.notes:
        con.print(f"note: {note}")
    con.print(
        f"entropy 1.000 = uniform routing; independent uniform routing would give overlap "
        f"{r.stats.random_overlap:.3f} and hot-k recall {r.stats.random_overlap:.3f}"
    )


# ------------------------------------------------------------------ convert
def _render_saved(con: Console, out: SaveResult, what: str) -> None:
    con.print(f"wrote {what} {out.path} ({out.format} v{out.version}, {human_bytes(out.bytes)})")
    for d in out.dropped:
        put(con, styled("dropped", "yellow"), f" (not carried by {out.format} v{out.version}): {d}")


def _render_convert(con: Console, r: ConvertResult) -> None:
    con.print(f"read {r.input} ({r.input_format}): {r.tokens:,} tokens x {r.layers} layers")
    if r.bound_to:
        con.print(f"checked against and bound to {r.bound_to}")
    for n in r.notes:
        con.print(f"note: {n}")
    _render_saved(con, r.output, "trace")


# ------------------------------------------------------------------ synth
def _render_synth(con: Console, r: SynthTraceResult) -> None:
    p = r.params
    target = f" for {r.model}" if r.model else ""
    con.print(
        f"synthetic trace{target}: {r.tokens:,} tokens ({r.prefill_tokens:,} prefill) x "
        f"{r.layers} layers, top-{r.k} of {r.n_expert} experts, {r.clusters} clusters; "
        f"locality {p['locality']}, persistence {p['persistence']}, cluster persistence "
        f"{p['cluster_persistence']}, layer coupling {p['layer_coupling']}"
    )
    _render_saved(con, r.output, "trace")


# ------------------------------------------------------------------ formats
def _render_formats(con: Console, rows: list[FormatRow]) -> None:
    con.print(
        table(
            "trace formats",
            ["name", "extensions", "writes versions", "description"],
            [
                [
                    r.name,
                    " ".join(r.extensions) or "-",
                    ", ".join(map(str, r.versions)),
                    r.description,
                ]
                for r in rows
            ],
        )
    )


@click.command("info")
@click.argument("trace", type=path_in)
@trace_format_option("--format", "fmt", DETECTED)
@n_expert_option(N_EXPERT_HELP)
@model_option
@count_option("--lag", 8, "Second overlap column: share of experts reused LAG tokens later.")
@count_option("--window", 1024, "Distinct experts per window of this many tokens.")
@block_map_option
@json_option
def info_cmd(
    trace: Path,
    fmt: str | None,
    n_expert: int | None,
    model_path: Path | None,
    lag: int,
    window: int,
    block_map: list[int] | None,
    as_json: bool,
) -> None:
    """Validate TRACE and show its shape, binding and routing statistics."""
    with hints(INFO_HINTS):
        result = trace_info(
            trace,
            fmt,
            n_expert,
            model_path,
            lag,
            window,
            block_map,
        )
    emit(result, as_json, _render_info)
    warn(result.warnings)


@click.command("convert")
@click.argument("src", metavar="IN", type=path_in)
@click.argument("dst", metavar="OUT", type=path_out)
@to_format_option
@trace_format_option("--from", "src_format", DETECTED)
@n_expert_option(N_EXPERT_HELP)
@model_option
@pmx_version_option("pmxtrace version to write (default 2; 1 has no prefill split).")
@click.option(
    "--strict", is_flag=True, help="Refuse to write when the output format would drop anything."
)
@block_map_option
@quiet_option
@json_option
@force_option
def convert_cmd(
    src: Path,
    dst: Path,
    to: str | None,
    src_format: str | None,
    n_expert: int | None,
    model_path: Path | None,
    pmx_version: str | None,
    strict: bool,
    block_map: list[int] | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """Convert trace IN to OUT. What OUT's format cannot carry is listed as dropped.
    With --model the trace is checked against the model and bound to it (fingerprint and
    block map recorded where the output format can carry them)."""
    progress = RichProgress(enabled=not quiet and not as_json)
    with hints(CONVERT_HINTS):
        try:
            result = trace_convert(
                src,
                dst,
                to=to,
                src_format=src_format,
                n_expert=n_expert,
                model_path=model_path,
                pmx_version=int(pmx_version) if pmx_version else None,
                strict=strict,
                progress=progress,
                block_map=block_map,
            )
        finally:
            progress.finish()
    warn(result.warnings)
    emit(result, as_json, _render_convert)


@click.command("synth")
@click.argument("out", type=path_out)
@model_option
@count_option("--layers", None, "MoE layers (without --model).")
@count_option("--experts", None, "Experts per layer (without --model).")
@count_option("--top-k", None, "Experts per token (without --model).")
@count_option("--tokens", 4096, "Tokens in the trace, prefill included.")
@count_option("--prefill", 0, "Leading prefill tokens (wide routing, no persistence).", low=0)
@count_option(
    "--clusters",
    None,
    "Co-activation clusters per layer (default: about 3 x top-k experts each).",
)
@fraction_option("--locality", 0.8, "Chance a fresh expert comes from the token's cluster.")
@fraction_option("--persistence", 0.4, "Mean share of the previous token's experts reused.")
@fraction_option("--cluster-persistence", 0.9, "Chance a token keeps the previous token's cluster.")
@fraction_option("--layer-coupling", 0.6, "Chance a layer takes the previous layer's cluster.")
@fraction_option("--prefill-locality", 0.1, "Locality during prefill.")
@click.option(
    "--weights/--no-weights", default=False, show_default=True, help="Include router weights."
)
@seed_option()
@to_format_option
@pmx_version_option("pmxtrace version to write (default 2).")
@block_map_option
@quiet_option
@json_option
@force_option
def synth_cmd(
    out: Path,
    model_path: Path | None,
    layers: int | None,
    experts: int | None,
    top_k: int | None,
    tokens: int,
    prefill: int,
    clusters: int | None,
    locality: float,
    persistence: float,
    cluster_persistence: float,
    layer_coupling: float,
    prefill_locality: float,
    weights: bool,
    seed: int,
    to: str | None,
    pmx_version: str | None,
    block_map: list[int] | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """Write a synthetic trace with planted structure to OUT, for --model or for
    --layers/--experts/--top-k. The ground truth (cluster of every expert) is kept in
    the native format's provenance."""
    progress = RichProgress(enabled=not quiet and not as_json)
    with hints(SYNTH_HINTS):
        try:
            result = write_synth_trace(
                out,
                model_path,
                to,
                int(pmx_version) if pmx_version else None,
                progress,
                tokens=tokens,
                layers=layers,
                n_expert=experts,
                top_k=top_k,
                prefill_tokens=prefill,
                structure=TraceStructure(
                    clusters,
                    locality,
                    persistence,
                    cluster_persistence,
                    layer_coupling,
                    prefill_locality,
                ),
                weights=weights,
                seed=seed,
                block_map=block_map,
            )
        finally:
            progress.finish()
    emit(result, as_json, _render_synth)


@click.command("formats")
@json_option
def formats_cmd(as_json: bool) -> None:
    """List the trace formats moepack reads and writes."""
    emit(list_formats(), as_json, _render_formats)
