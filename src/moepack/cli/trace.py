"""CLI for routing traces: ``moepack trace info | convert | synth | formats``."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from ..checkpoint.model import MoeModel
from ..errors import BadInput
from ..trace import RoutingTrace, TraceNeeds, load_trace, save_trace, summarize, synth_trace
from ..trace.core import (
    NEED_BLOCK_MAP,
    NEED_FORMAT,
    NEED_N_EXPERT,
    NEED_OUTPUT_FORMAT,
    describe_blocks,
    parse_block_map,
)
from ..trace.formats import FORMATS, SaveResult, detect_format, get_format, output_format
from ..trace.stats import TraceStats
from .common import json_option, quiet_option
from .render import RichProgress, emit, human_bytes, table

FORMAT_CHOICE = click.Choice(sorted(FORMATS))
path_in = click.Path(exists=True, dir_okay=False, path_type=Path)
model_option = click.option(
    "--model",
    "model_path",
    type=path_in,
    default=None,
    help="GGUF model the trace belongs to: supplies the expert count and is checked against.",
)
block_map_option = click.option(
    "--block-map",
    default=None,
    metavar="LIST",
    help="GGUF block of each trace layer, in order, e.g. 0-23 or 1,3,5 (needed when the trace "
    "covers only some MoE blocks; replaces a block map the trace records).",
)
n_expert_option = click.option(
    "--n-expert",
    type=click.IntRange(min=1),
    default=None,
    help="Experts per layer, for text traces that do not declare it (never guessed).",
)


# What each command adds to a library error about a fact the trace lacks: the option that
# supplies it there (the library's messages name no options; other commands have other ones).
_BLOCK_MAP_HINT = "give --block-map LIST to say which MoE blocks its layers are"
_N_EXPERT_HINT = "pass --n-expert N or --model MODEL"
INFO_HINTS = {
    NEED_FORMAT: "name it with --format",
    NEED_N_EXPERT: _N_EXPERT_HINT,
    NEED_BLOCK_MAP: _BLOCK_MAP_HINT,
}
CONVERT_HINTS = {
    NEED_FORMAT: "name it with --from",
    NEED_OUTPUT_FORMAT: "name it with --to",
    NEED_N_EXPERT: _N_EXPERT_HINT,
    NEED_BLOCK_MAP: _BLOCK_MAP_HINT,
}
SYNTH_HINTS = {
    NEED_OUTPUT_FORMAT: "name it with --to",
    NEED_BLOCK_MAP: "give --model, or --block-map LIST to say which blocks its layers are",
}


@contextmanager
def hints(table: dict[str, str]) -> Iterator[None]:
    """Append this command's option for what a ``TraceNeeds`` error says is missing."""
    try:
        yield
    except TraceNeeds as e:
        hint = table.get(e.need)
        if hint is None:
            raise
        raise e.with_hint(hint) from None


def _fmt(x: float, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _open_model(path: Path | None) -> MoeModel | None:
    return MoeModel(path) if path is not None else None


def _binding(trace: RoutingTrace, model: MoeModel, blocks: list[int]) -> dict[str, Any]:
    return {
        "model": str(model.path),
        "fingerprint": model.fingerprint,
        "fingerprint_matches": trace.model_fingerprint == model.fingerprint
        if trace.model_fingerprint
        else None,
        "blocks": blocks,
    }


# ------------------------------------------------------------------ info
@dataclass
class InfoResult:
    format: str
    file_bytes: int
    stats: TraceStats

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "file_bytes": self.file_bytes, **self.stats.to_json()}


def _render_info(con: Console, r: InfoResult) -> None:
    s = r.stats.summary
    prov = s.get("provenance") or {}
    con.print(f"[bold]{s['path']}[/bold]  ({r.format}, {human_bytes(r.file_bytes)})")
    bm = s["block_map"]
    rows = [
        [
            "tokens",
            f"{s['tokens']:,} ({s['prefill_tokens']:,} prefill, {s['decode_tokens']:,} decode)",
        ],
        ["layers x top-k", f"{s['layers']} x {s['k']} of {s['n_expert']} experts"],
        ["router weights", "yes" if s["weights"] else "no"],
        ["block map", describe_blocks(bm) if bm is not None else "not recorded (i-th MoE block)"],
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
        rows.append(["fits model", f"{b['model']} ({fp}; blocks {describe_blocks(b['blocks'])})"])
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


def trace_info(
    path: Path,
    fmt: str | None = None,
    n_expert: int | None = None,
    model_path: Path | None = None,
    lag: int = 8,
    window: int = 1024,
    block_map: list[int] | None = None,
) -> InfoResult:
    """Read, validate and summarise a trace (and check it against a model when given).
    ``block_map`` sets the trace's block map first (checked against the model, if any)."""
    mod = get_format(fmt) if fmt else detect_format(path)
    model = _open_model(model_path)
    try:
        trace = load_trace(path, format=mod.NAME, n_expert=n_expert, model=model, check=False)
        if block_map is not None:
            trace = trace.replace(block_map=block_map)
        blocks = trace.check_against(model) if model is not None else None
        stats = summarize(trace, lag=lag, window=window, blocks=blocks)
        if model is not None and blocks is not None:
            stats.binding = _binding(trace, model, blocks)
    finally:
        if model is not None:
            model.close()
    return InfoResult(format=mod.NAME, file_bytes=path.stat().st_size, stats=stats)


# ------------------------------------------------------------------ convert
def _pmx_version(to: str | None, dst: Path, pmx_version: int | None) -> int | None:
    """Check before any work that OUT's format is known; ``--pmx-version`` is only meaningful
    for pmxtrace output."""
    out_mod = output_format(dst, to)
    if pmx_version is not None and out_mod.NAME != "pmxtrace":
        raise BadInput("--pmx-version applies only to pmxtrace output", dst)
    return pmx_version


@dataclass
class ConvertResult:
    input: Path
    input_format: str
    output: SaveResult
    tokens: int
    layers: int
    bound_to: str | None = None
    notes: list[str] = field(default_factory=list)


def _render_saved(con: Console, out: SaveResult, what: str) -> None:
    con.print(f"wrote {what} {out.path} ({out.format} v{out.version}, {human_bytes(out.bytes)})")
    for d in out.dropped:
        con.print(f"[yellow]dropped[/yellow] (not carried by {out.format} v{out.version}): {d}")


def _render_convert(con: Console, r: ConvertResult) -> None:
    con.print(f"read {r.input} ({r.input_format}): {r.tokens:,} tokens x {r.layers} layers")
    if r.bound_to:
        con.print(f"checked against and bound to {r.bound_to}")
    for n in r.notes:
        con.print(f"note: {n}")
    _render_saved(con, r.output, "trace")


def trace_convert(
    src: Path,
    dst: Path,
    to: str | None = None,
    src_format: str | None = None,
    n_expert: int | None = None,
    model_path: Path | None = None,
    pmx_version: int | None = None,
    strict: bool = False,
    progress: Any = None,
    block_map: list[int] | None = None,
) -> ConvertResult:
    """Convert a trace between formats. ``block_map`` sets the trace's block map first. With a
    model, the trace is checked against it and the output records the model's fingerprint and
    the block map."""
    version = _pmx_version(to, dst, pmx_version)
    in_mod = get_format(src_format) if src_format else detect_format(src)
    model = _open_model(model_path)
    try:
        trace = load_trace(src, format=in_mod.NAME, n_expert=n_expert, model=model, check=False)
        if block_map is not None:
            trace = trace.replace(block_map=block_map)
        bound = None
        model_files: tuple[Path, ...] = ()
        if model is not None:
            trace = trace.bound_to(model)
            bound = str(model.path)
            model_files = tuple(model.shard_paths)
    finally:
        if model is not None:
            model.close()
    kwargs: dict[str, Any] = {"progress": progress} if progress is not None else {}
    out = save_trace(
        trace, dst, format=to, version=version, strict=strict, inputs=model_files, **kwargs
    )
    notes = [str(n) for n in trace.provenance.get("notes", []) or []]
    return ConvertResult(
        input=src,
        input_format=in_mod.NAME,
        output=out,
        tokens=trace.tokens,
        layers=trace.layers,
        bound_to=bound,
        notes=notes,
    )


# ------------------------------------------------------------------ synth
@dataclass
class SynthTraceResult:
    output: SaveResult
    tokens: int
    prefill_tokens: int
    layers: int
    n_expert: int
    k: int
    clusters: int
    params: dict[str, Any]
    model: str | None = None


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
@dataclass
class FormatRow:
    name: str
    extensions: list[str]
    versions: list[int]
    description: str


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


def register(cli: click.Group) -> None:
    """Add the ``trace`` group to ``cli``."""

    @cli.group("trace")
    def trace_group() -> None:
        """Routing traces: which experts the router chose, per token and layer."""

    @trace_group.command("info")
    @click.argument("trace", type=path_in)
    @click.option(
        "--format",
        "fmt",
        type=FORMAT_CHOICE,
        default=None,
        help="Input format (default: detected by magic, then extension).",
    )
    @n_expert_option
    @model_option
    @click.option(
        "--lag",
        type=click.IntRange(min=1),
        default=8,
        show_default=True,
        help="Second overlap column: share of experts reused LAG tokens later.",
    )
    @click.option(
        "--window",
        type=click.IntRange(min=1),
        default=1024,
        show_default=True,
        help="Distinct experts per window of this many tokens.",
    )
    @block_map_option
    @json_option
    def info_cmd(
        trace: Path,
        fmt: str | None,
        n_expert: int | None,
        model_path: Path | None,
        lag: int,
        window: int,
        block_map: str | None,
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
                parse_block_map(block_map) if block_map else None,
            )
        emit(result, as_json, _render_info)

    @trace_group.command("convert")
    @click.argument("src", metavar="IN", type=path_in)
    @click.argument("dst", metavar="OUT", type=click.Path(path_type=Path))
    @click.option(
        "--to",
        "to",
        type=FORMAT_CHOICE,
        default=None,
        help="Output format (default: from OUT's extension).",
    )
    @click.option(
        "--from",
        "src_format",
        type=FORMAT_CHOICE,
        default=None,
        help="Input format (default: detected by magic, then extension).",
    )
    @n_expert_option
    @model_option
    @click.option(
        "--pmx-version",
        type=click.Choice(["1", "2"]),
        default=None,
        help="pmxtrace version to write (default 2; 1 has no prefill split).",
    )
    @click.option(
        "--strict", is_flag=True, help="Refuse to write when the output format would drop anything."
    )
    @block_map_option
    @quiet_option
    @json_option
    def convert_cmd(
        src: Path,
        dst: Path,
        to: str | None,
        src_format: str | None,
        n_expert: int | None,
        model_path: Path | None,
        pmx_version: str | None,
        strict: bool,
        block_map: str | None,
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
                    to,
                    src_format,
                    n_expert,
                    model_path,
                    int(pmx_version) if pmx_version else None,
                    strict,
                    progress,
                    parse_block_map(block_map) if block_map else None,
                )
            finally:
                progress.finish()
        emit(result, as_json, _render_convert)

    @trace_group.command("synth")
    @click.argument("out", type=click.Path(path_type=Path))
    @model_option
    @click.option(
        "--layers", type=click.IntRange(min=1), default=None, help="MoE layers (without --model)."
    )
    @click.option(
        "--experts",
        type=click.IntRange(min=1),
        default=None,
        help="Experts per layer (without --model).",
    )
    @click.option(
        "--top-k",
        type=click.IntRange(min=1),
        default=None,
        help="Experts per token (without --model).",
    )
    @click.option(
        "--tokens",
        type=click.IntRange(min=1),
        default=4096,
        show_default=True,
        help="Tokens in the trace, prefill included.",
    )
    @click.option(
        "--prefill",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="Leading prefill tokens (wide routing, no persistence).",
    )
    @click.option(
        "--clusters",
        type=click.IntRange(min=1),
        default=None,
        help="Co-activation clusters per layer (default: about 3 x top-k experts each).",
    )
    @click.option(
        "--locality",
        type=click.FloatRange(0, 1),
        default=0.8,
        show_default=True,
        help="Chance a fresh expert comes from the token's cluster.",
    )
    @click.option(
        "--persistence",
        type=click.FloatRange(0, 1),
        default=0.4,
        show_default=True,
        help="Mean share of the previous token's experts reused.",
    )
    @click.option(
        "--cluster-persistence",
        type=click.FloatRange(0, 1),
        default=0.9,
        show_default=True,
        help="Chance a token keeps the previous token's cluster.",
    )
    @click.option(
        "--layer-coupling",
        type=click.FloatRange(0, 1),
        default=0.6,
        show_default=True,
        help="Chance a layer takes the previous layer's cluster.",
    )
    @click.option(
        "--prefill-locality",
        type=click.FloatRange(0, 1),
        default=0.1,
        show_default=True,
        help="Locality during prefill.",
    )
    @click.option(
        "--weights/--no-weights", default=False, show_default=True, help="Include router weights."
    )
    @click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
    @click.option(
        "--to",
        "to",
        type=FORMAT_CHOICE,
        default=None,
        help="Output format (default: from OUT's extension).",
    )
    @click.option(
        "--pmx-version",
        type=click.Choice(["1", "2"]),
        default=None,
        help="pmxtrace version to write (default 2).",
    )
    @block_map_option
    @quiet_option
    @json_option
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
        block_map: str | None,
        quiet: bool,
        as_json: bool,
    ) -> None:
        """Write a synthetic trace with planted structure to OUT, for --model or for
        --layers/--experts/--top-k. The ground truth (cluster of every expert) is kept in
        the native format's provenance."""
        with hints(SYNTH_HINTS):
            version = _pmx_version(to, out, int(pmx_version) if pmx_version else None)
            model = _open_model(model_path)
            try:
                trace = synth_trace(
                    model,
                    tokens=tokens,
                    layers=layers,
                    n_expert=experts,
                    top_k=top_k,
                    prefill_tokens=prefill,
                    clusters=clusters,
                    locality=locality,
                    persistence=persistence,
                    cluster_persistence=cluster_persistence,
                    layer_coupling=layer_coupling,
                    prefill_locality=prefill_locality,
                    weights=weights,
                    seed=seed,
                    block_map=parse_block_map(block_map) if block_map else None,
                )
            finally:
                if model is not None:
                    model.close()
            progress = RichProgress(enabled=not quiet and not as_json)
            try:
                saved = save_trace(
                    trace,
                    out,
                    format=to,
                    version=version,
                    inputs=(model_path,) if model_path else (),
                    progress=progress,
                )
            finally:
                progress.finish()
        info = trace.provenance["synth"]
        emit(
            SynthTraceResult(
                output=saved,
                tokens=trace.tokens,
                prefill_tokens=trace.prefill_tokens,
                layers=trace.layers,
                n_expert=trace.n_expert,
                k=trace.k,
                clusters=int(info["params"]["clusters"]),
                params=dict(info["params"]),
                model=str(model_path) if model_path else None,
            ),
            as_json,
            _render_synth,
        )

    @trace_group.command("formats")
    @json_option
    def formats_cmd(as_json: bool) -> None:
        """List the trace formats moepack reads and writes."""
        rows = [
            FormatRow(m.NAME, list(m.EXTENSIONS), list(m.VERSIONS), m.DESCRIPTION)
            for m in FORMATS.values()
        ]
        emit(rows, as_json, _render_formats)

    from . import trace_stats  # `trace stats` lives in its own module

    trace_stats.register(trace_group)
