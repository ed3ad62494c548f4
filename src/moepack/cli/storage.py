"""CLI for storage: ``probe``, ``kio``, ``engines`` and ``surface show|convert|plot``.

Parsing and rendering only; ``moepack.storage`` measures and returns result objects.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from ..errors import BadInput
from ..filekinds import IMAGE, SURFACE, check_output_kind
from ..safeio import AtomicOutputs, check_destination, describe_os_error, write_bytes_atomic
from ..storage import kio as kio_mod
from ..storage import probe as probe_mod
from ..storage.corpus import remove_corpus
from ..storage.engine import all_engines
from ..storage.modes import Mode
from ..storage.support import mode_support
from ..storage.surface import FORMAT_NAME, PEER_FORMAT, Surface
from ..storage.units import format_size, parse_size
from .common import json_option, quiet_option
from .render import RichProgress, emit, human_bytes, stderr, table, to_jsonable

MODE_CHOICE = click.Choice([m.value for m in Mode])


class SizeType(click.ParamType):
    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(str(value))
        except BadInput as e:
            self.fail(e.message, param, ctx)


class PointType(click.ParamType):
    """``SIZE@QD``, e.g. ``864K@8``: a request size and a queue depth."""

    name = "SIZE@QD"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[int, int]:
        if isinstance(value, tuple):
            return value
        size_text, sep, qd_text = str(value).partition("@")
        if not sep or not qd_text.strip().isdigit() or int(qd_text) < 1:
            self.fail(f"want SIZE@QD with a depth of 1 or more, e.g. 864K@8; got {value!r}",
                      param, ctx)  # fmt: skip
        try:
            return parse_size(size_text.strip()), int(qd_text)
        except BadInput as e:
            self.fail(f"{value!r}: {e.message}", param, ctx)


class ListType(click.ParamType):
    """Comma-separated values (sizes, depths or names)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.name = {"size": "SIZES", "int": "DEPTHS", "str": "NAMES"}[kind]

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list:
        if isinstance(value, list):
            return value
        items = [v.strip() for v in str(value).split(",") if v.strip()]
        if not items:
            self.fail("give at least one value", param, ctx)
        out: list[Any] = []
        for v in items:
            if self.kind == "size":
                try:
                    out.append(parse_size(v))
                except BadInput as e:
                    self.fail(e.message, param, ctx)
            elif self.kind == "int":
                if not v.isdigit() or int(v) < 1:
                    self.fail(f"not a positive whole number: {v!r}", param, ctx)
                out.append(int(v))
            else:
                out.append(v)
        return out


def _f(v: float | None, fmt: str = "{:.3f}") -> str:
    return "–" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v)


def _range(low: float | None, high: float | None) -> str:
    """A cell's spread over its runs, in GB/s."""
    if low is None or high is None:
        return "–"
    return f"{low / 1e9:.3f}–{high / 1e9:.3f}"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v * 100:+.1f}%"


def _warn(lines: list[str]) -> None:
    for line in lines:
        stderr.print(f"[yellow]warning:[/] {line}", soft_wrap=True)


def _show(console: Console, t: Any) -> None:
    """Print a table; when piped (no terminal), wide enough that no number is cut."""
    if console.is_terminal:
        console.print(t)
    else:
        wide = Console(file=console.file, width=max(console.width, 150), highlight=False)
        wide.print(t)


def _device_line(dev: dict[str, Any]) -> str:
    parts = [dev.get("block_device") or dev.get("source"), dev.get("model"), dev.get("filesystem")]
    return ", ".join(str(p) for p in parts if p) + f"; kernel {dev.get('kernel')}"


def _write_together(files: list[tuple[Path, bytes]], inputs: list[Path]) -> list[Path]:
    """Write every (path, bytes) through one ``AtomicOutputs``: all of them, or none."""
    if not files:
        return []
    failed = files[0][0]
    try:
        with AtomicOutputs(inputs) as outs:
            for path, data in files:
                failed = path
                outs.open(path).write(data)
    except OSError as e:
        raise describe_os_error(e, failed) from None
    return [p for p, _ in files]


# -- probe ---------------------------------------------------------------------------------


def _surface_grid(console: Console, s: Surface, title: str) -> None:
    depths = s.queue_depths
    rows = []
    for size in s.request_sizes:
        row = [format_size(size)]
        for qd in depths:
            c = s.cell(size, qd)
            row.append(_f(c.bytes_per_sec / 1e9) if c else "")
        rows.append(row)
    cols = ["size \\ QD"] + [str(d) for d in depths]
    _show(console, table(title, cols, rows, right=set(range(1, len(cols)))))


def _surface_cells(console: Console, s: Surface) -> None:
    rows = [
        [
            format_size(c.request_bytes),
            c.queue_depth,
            _f(c.bytes_per_sec / 1e9),
            _range(c.bytes_per_sec_low, c.bytes_per_sec_high),
            c.repeats or 1,
            _f(c.iops, "{:,.0f}"),
            _f(c.lat_p50_us, "{:,.0f}"),
            _f(c.lat_p99_us, "{:,.0f}"),
            _f(c.cpu_sec_per_gb, "{:.2f}"),
            c.requests if c.requests is not None else "–",
        ]  # fmt: skip
        for c in s.cells
    ]
    cols = ["size", "QD", "GB/s", "range", "runs", "IOPS", "p50 µs", "p99 µs", "CPU s/GB",
            "requests"]  # fmt: skip
    _show(console, table("cells", cols, rows, right=set(range(1, len(cols)))))


@click.command("probe")
@click.argument("target", type=click.Path(path_type=Path))
@click.option("--engine", "-e", help="Read engine (default: uring, else threads). See `engines`.")
@click.option(
    "--mode", "-m", type=MODE_CHOICE, default="direct", show_default=True,
    help="direct = O_DIRECT; buffered and dontcache start each cell with the file's pages dropped.",
)  # fmt: skip
@click.option(
    "--sizes", type=ListType("size"), help="Request sizes, e.g. 4K,64K,1M (default 4K…32M)."
)
@click.option("--depths", type=ListType("int"), help="Queue depths, e.g. 1,8,32 (default 1…64).")
@click.option(
    "--cell-seconds", type=float, default=probe_mod.DEFAULT_CELL_SECONDS, show_default=True,
    help="Time bound of each cell.",
)  # fmt: skip
@click.option(
    "--repeats", type=click.IntRange(1, 100), default=probe_mod.DEFAULT_REPEATS,
    show_default=True, help="Runs of each cell, interleaved; the surface keeps their median.",
)  # fmt: skip
@click.option(
    "--corpus-size", type=SizeType(), default=probe_mod.DEFAULT_CORPUS,
    help="Size of the corpus made when TARGET is a folder (default 2G).",
)  # fmt: skip
@click.option("--out", "-o", type=click.Path(path_type=Path), help="Write the surface here.")
@click.option(
    "--format", "fmt", type=click.Choice([FORMAT_NAME, PEER_FORMAT]), default=FORMAT_NAME,
    show_default=True, help="Surface file format (potatomaxx = the peer tool's probe JSON).",
)  # fmt: skip
@click.option("--png", type=click.Path(path_type=Path), help="Also draw the surface as a heatmap.")
@click.option("--cells", "show_cells", is_flag=True, help="Also list every cell (latency, CPU).")
@json_option
@quiet_option
def probe_cmd(
    target: Path, engine: str | None, mode: str, sizes: list[int] | None,
    depths: list[int] | None, cell_seconds: float, repeats: int, corpus_size: int,
    out: Path | None, fmt: str, png: Path | None, show_cells: bool, as_json: bool, quiet: bool,
) -> None:  # fmt: skip
    """Measure the read bandwidth surface (request size × queue depth) of TARGET's device.

    TARGET is a folder (a corpus file is created there once and reused) or an existing file,
    e.g. the model itself, which is only read (the pages of it that were cached are read back
    afterwards). Every cell starts cold and runs --repeats times, interleaved with the others.
    """
    from ..storage.heatmap import heatmap_png

    inputs = probe_mod.probe_inputs(target)  # the probed file, or the corpus a folder holds
    for dest, kind in ((out, SURFACE), (png, IMAGE)):
        if dest is not None:
            check_destination(dest, inputs)
            check_output_kind(dest, kind)
    if out is not None and png is not None and out.resolve() == png.resolve():
        raise BadInput("--out and --png name the same file", out)
    result = probe_mod.run_probe(
        target, engine=engine, mode=Mode(mode), sizes=sizes, depths=depths,
        cell_seconds=cell_seconds, corpus_bytes=corpus_size, progress=RichProgress(not quiet),
        repeats=repeats,
    )  # fmt: skip
    files = []  # the surface and the heatmap appear together or not at all
    if out is not None:
        files.append((out, result.surface.encode(fmt)))
    if png is not None:
        files.append((png, heatmap_png(result.surface)))
    written = [str(p) for p in _write_together(files, [result.target])]
    _warn(result.warnings)

    def render(console: Console, r: probe_mod.ProbeResult) -> None:
        s = r.surface
        console.print(f"device: {_device_line(s.device or {})}")
        console.print(
            f"file: {r.target}" + (" (corpus created)" if r.corpus_created else "")
            + f"; engine {s.engine}, {Mode(s.mode or 'direct').label}, {s.cell_seconds:g} s/run, "
            f"{repeats} interleaved runs per cell"
        )  # fmt: skip
        _surface_grid(console, s, "GB/s (median of the runs; --cells shows their range)")
        if r.cache_restored_bytes:
            console.print(
                f"page cache: {r.cache_restored_bytes / 2**20:,.0f} MiB of {r.target.name} were "
                "cached before the probe; asked the kernel to read them back (WILLNEED)"
            )
        if show_cells:
            _surface_cells(console, s)
        for w in written:
            console.print(f"wrote {w}")
        if not written:
            console.print("(pass --out FILE to keep the surface, --png FILE for a heatmap)")

    emit(
        {"target": result.target, "corpus_created": result.corpus_created,
         "surface": result.surface.to_json(), "warnings": result.warnings, "written": written,
         "cache_restored_bytes": result.cache_restored_bytes}
        if as_json else result,
        as_json, render,
    )  # fmt: skip


# -- kio -----------------------------------------------------------------------------------


def _render_kio(console: Console, r: kio_mod.KioReport) -> None:
    console.print(f"device: {_device_line(r.device)}")
    console.print(
        f"corpus: {r.corpus} ({human_bytes(r.corpus_bytes)}, "
        f"{'created' if r.corpus_created else 'reused'}); each cell cold, {r.repeats} "
        f"interleaved runs of {r.cell_seconds:g} s; GB/s is their median, range the slowest "
        "and fastest"
    )
    rows = []
    for row in r.rows:
        c = row.cell
        res = c.residency
        rows.append(
            [
                row.engine, Mode(row.mode).label, format_size(row.request_bytes), row.queue_depth,
                _f(row.gbps), _range(c.bytes_per_sec_low, c.bytes_per_sec_high),
                _f(row.ratio_qd1, "{:.2f}×"), _f(c.iops, "{:,.0f}"),
                _f(c.lat_p50_us, "{:,.0f}"), _f(c.lat_p99_us, "{:,.0f}"),
                _f(c.cpu_sec_per_gb, "{:.2f}"),
                "–" if res is None or row.mode == Mode.DIRECT.value else f"{res * 100:.0f}%",
            ]
        )  # fmt: skip
    cols = ["engine", "mode", "size", "QD", "GB/s", "range", "×QD1", "IOPS", "p50 µs",
            "p99 µs", "CPU s/GB", "cached"]  # fmt: skip
    _show(console, table("read paths", cols, rows, right=set(range(3, len(cols)))))
    if r.windows:
        _show(
            console,
            table(
                "io_uring: sliding window vs batch-and-drain",
                ["mode", "size", "QD", "sliding GB/s", "batch GB/s", "sliding gain", "verdict"],
                [
                    [Mode(w.mode).label, format_size(w.request_bytes), w.queue_depth,
                     _f(w.sliding_gbps), _f(w.batch_gbps), _pct(w.gain),
                     "within noise" if w.within_noise else
                     ("sliding faster" if w.gain > 0 else "batch faster")]
                    for w in r.windows
                ],
                right={2, 3, 4, 5},
            )
        )  # fmt: skip
    if r.dontcache:
        _show(
            console,
            table(
                "RWF_DONTCACHE vs buffered: speed, and share of the bytes read left in the cache",
                ["engine", "size", "QD", "buffered GB/s", "DONTCACHE GB/s", "change",
                 "buffered cached", "DONTCACHE cached"],
                [
                    [d.engine, format_size(d.request_bytes), d.queue_depth, _f(d.buffered_gbps),
                     _f(d.dontcache_gbps),
                     _pct(-d.cost) + (" (noise)" if d.within_noise else ""),
                     _f(d.buffered_residency and d.buffered_residency * 100, "{:.0f}%"),
                     _f(d.dontcache_residency and d.dontcache_residency * 100, "{:.0f}%")]
                    for d in r.dontcache
                ],
                right={2, 3, 4, 5, 6, 7},
            )
        )  # fmt: skip
    for s in r.skipped:
        console.print(f"[yellow]skipped {s.what} {s.name}:[/] {s.reason}")
    for t in r.thrash:
        console.print(f"[red]thrash:[/] {t}")
    if not r.thrash and r.dontcache:
        console.print("no thrash: the kernel evicted no corpus pages during any cell")
    for rec in r.recommendations:
        line = (
            f"[bold]recommend for {format_size(rec.request_bytes)} reads:[/] {rec.engine} "
            f"{Mode(rec.mode).label} at QD {rec.queue_depth} — {rec.gbps:.3f} GB/s"
        )
        if rec.runner_up is not None and rec.margin is not None:
            line += f", {rec.margin * 100:+.1f}% over {rec.runner_up} ({rec.runner_up_gbps:.3f})"
            if rec.tie and rec.runner_up_range_gbps:
                lo, hi = rec.best_range_gbps
                rlo, rhi = rec.runner_up_range_gbps
                line += (
                    f"; a tie: their runs overlap ({lo:.3f}–{hi:.3f} vs {rlo:.3f}–{rhi:.3f} "
                    "GB/s), either will do"
                )
        if rec.cache_note:
            line += f" ({rec.cache_note})"
        console.print(line)


@click.command("kio")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--sizes", type=ListType("size"), help="Request sizes (default 64K,1M).")
@click.option("--depths", type=ListType("int"), help="Queue depths (default 1,8,32).")
@click.option("--engines", type=ListType("str"), help="Engines to compare (default: all).")
@click.option(
    "--modes", type=ListType("str"), help="Modes: direct, buffered, dontcache (default: all)."
)
@click.option(
    "--cell-seconds", type=float, default=kio_mod.DEFAULT_CELL_SECONDS, show_default=True,
    help="Time bound of each cell.",
)  # fmt: skip
@click.option(
    "--repeats", type=click.IntRange(1, 100), default=kio_mod.DEFAULT_REPEATS,
    show_default=True, help="Runs of each cell, interleaved; tables show median and range.",
)  # fmt: skip
@click.option(
    "--corpus-size", type=SizeType(), default=kio_mod.DEFAULT_CORPUS,
    help="Size of the corpus file in DIRECTORY (default 2G; created once, then reused).",
)  # fmt: skip
@click.option(
    "--remove-corpus", is_flag=True, help="Delete the corpus in DIRECTORY and exit (no run)."
)
@json_option
@quiet_option
def kio_cmd(
    directory: Path, sizes: list[int] | None, depths: list[int] | None,
    engines: list[str] | None, modes: list[str] | None, cell_seconds: float, repeats: int,
    corpus_size: int, remove_corpus: bool, as_json: bool, quiet: bool,
) -> None:  # fmt: skip
    """Compare read engines and modes on DIRECTORY's device: GB/s, latency, CPU, cache cost.

    Every cell starts cold (pages dropped with fadvise, residency checked with cachestat) and
    runs --repeats times, interleaved with the others; a winner must beat the runner-up in
    every run. A default run takes about a minute once the 2 GiB corpus exists.
    """
    if remove_corpus:
        gone = remove_corpus_fn(directory)
        emit(
            {"removed": gone},
            as_json,
            lambda c, r: c.print(f"removed {r['removed']}" if r["removed"] else "no corpus here"),
        )
        return
    mode_list = None
    if modes:
        valid = [m.value for m in Mode]
        bad = [m for m in modes if m not in valid]
        if bad:
            raise BadInput(f"unknown mode {bad[0]!r}; choose from {', '.join(valid)}")
        mode_list = [Mode(m) for m in modes]
    report = kio_mod.run_kio(
        directory, sizes=sizes, depths=depths, engines=engines, modes=mode_list,
        cell_seconds=cell_seconds, corpus_bytes=corpus_size, progress=RichProgress(not quiet),
        repeats=repeats,
    )  # fmt: skip
    _warn(report.warnings)
    emit(report, as_json, _render_kio)


remove_corpus_fn = remove_corpus


# -- engines -------------------------------------------------------------------------------


@click.command("engines")
@click.argument("path", required=False, type=click.Path(path_type=Path))
@click.option("--no-bindings", is_flag=True, help="Skip checking the PyPI io_uring bindings.")
@json_option
def engines_cmd(path: Path | None, no_bindings: bool, as_json: bool) -> None:
    """List the read engines, which modes PATH's filesystem serves, and the io_uring bindings."""
    from ..storage.uring.bindings import check_bindings

    engines = all_engines()
    result: dict[str, Any] = {
        "engines": [
            {
                "name": e.name,
                "summary": e.summary,
                "modes": [m.value for m in Mode if m in e.modes],
                "max_depth": e.max_depth,
                "unavailable": e.unavailable_reason(),
            }
            for e in engines.values()
        ]
    }
    if path is not None:
        support = mode_support(path)
        result["modes"] = {"file": support.file, "unsupported": support.unsupported,
                           "untested": support.untested}  # fmt: skip
        if support.dio_align:
            a = support.dio_align
            result["dio_align"] = {"mem": a.mem, "offset": a.offset, "source": a.source}
    if not no_bindings:
        result["bindings"] = [to_jsonable(b) for b in check_bindings()]

    def render(console: Console, r: dict[str, Any]) -> None:
        _show(
            console,
            table(
                "read engines",
                ["engine", "modes", "max QD", "status", "what"],
                [
                    [e["name"], ", ".join(e["modes"]), e["max_depth"] or "any",
                     "ok" if not e["unavailable"] else f"unavailable: {e['unavailable']}",
                     e["summary"]]
                    for e in r["engines"]
                ],
            )
        )  # fmt: skip
        if "modes" in r and r["modes"]["untested"]:
            console.print(f"modes on {r['modes']['file']}: untested ({r['modes']['untested']})")
        elif "modes" in r:
            console.print(f"modes on {r['modes']['file']}:")
            for m, why in r["modes"]["unsupported"].items():
                console.print(f"  {Mode(m).label}: " + ("ok" if why is None else f"no — {why}"))
            if "dio_align" in r:
                a = r["dio_align"]
                console.print(
                    f"  O_DIRECT alignment: memory {a['mem']} B, offset/length {a['offset']} B "
                    f"(from {a['source']})"
                )
        if "bindings" in r:
            _show(
                console,
                table(
                    "io_uring bindings (each checked in a subprocess)",
                    ["binding", "usable", "detail"],
                    [[b["name"], "yes" if b["usable"] else "no", b["detail"]] for b in r["bindings"]],
                )
            )  # fmt: skip

    emit(result, as_json, render)


# -- surface files -------------------------------------------------------------------------


@click.group("surface")
def surface_group() -> None:
    """Show, query, convert and plot surface files (moepack's or potatomaxx's probe JSON)."""


@surface_group.command("show")
@click.argument("file", type=click.Path(path_type=Path))
@click.option(
    "--at", "points", type=PointType(), multiple=True,
    help="Predict bandwidth at a request size and depth, e.g. --at 864K@8 (repeatable).",
)  # fmt: skip
@click.option("--cells", "show_cells", is_flag=True, help="Also list every cell (latency, CPU).")
@json_option
def surface_show(
    file: Path, points: tuple[tuple[int, int], ...], show_cells: bool, as_json: bool
) -> None:
    """Print a surface; with --at, the interpolated bandwidth at those points."""
    s = Surface.load(file)
    answers = [
        {"request_bytes": size, "queue_depth": qd, "bytes_per_sec": s.bandwidth(size, qd)}
        for size, qd in points
    ]

    def render(console: Console, _: Any) -> None:
        fmt_name = (
            "moepack surface v1" if s.source_format == FORMAT_NAME else "potatomaxx probe JSON"
        )
        console.print(f"{file}: {fmt_name}, {len(s.cells)} cells")
        if s.device:
            console.print(f"device: {_device_line(s.device)}")
        meta = [f"{k} {v}" for k, v in (("engine", s.engine), ("mode", s.mode),
                                          ("measured", s.created)) if v]  # fmt: skip
        if meta:
            console.print("; ".join(meta))
        if s.note:
            console.print(f"note: {s.note}")
        _surface_grid(console, s, "GB/s")
        if show_cells:
            _surface_cells(console, s)
        for a in answers:
            console.print(
                f"bandwidth at {format_size(a['request_bytes'])} QD {a['queue_depth']}: "
                f"{a['bytes_per_sec'] / 1e9:.3f} GB/s (interpolated, log-log)"
            )

    emit({"surface": s.to_json(), "predictions": answers}, as_json, render)


@surface_group.command("convert")
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dest", type=click.Path(path_type=Path))
@click.option(
    "--to", "fmt", type=click.Choice([FORMAT_NAME, PEER_FORMAT]), required=True,
    help="Format to write.",
)  # fmt: skip
@json_option
def surface_convert(src: Path, dest: Path, fmt: str, as_json: bool) -> None:
    """Rewrite a surface file in the other format (potatomaxx keeps only size, depth, GB/s)."""
    check_destination(dest, [src])
    s = Surface.load(src)
    s.save(dest, fmt, inputs=[src])
    emit({"written": str(dest), "format": fmt, "cells": len(s.cells)}, as_json,
         lambda con, r: con.print(f"wrote {r['written']} ({r['format']}, {r['cells']} cells)",
                                 markup=False))  # fmt: skip


@surface_group.command("plot")
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("png", type=click.Path(path_type=Path))
@click.option("--title", help="Title above the heatmap.")
@json_option
def surface_plot(src: Path, png: Path, title: str | None, as_json: bool) -> None:
    """Draw a surface file as a heatmap PNG."""
    from ..storage.heatmap import heatmap_png

    check_destination(png, [src])
    check_output_kind(png, IMAGE)
    s = Surface.load(src)
    data = heatmap_png(s, title)
    write_bytes_atomic(png, data, inputs=[src])
    emit({"written": str(png), "bytes": len(data), "cells": len(s.cells)}, as_json,
         lambda con, r: con.print(f"wrote {r['written']}", markup=False))  # fmt: skip


def register(cli: click.Group) -> None:
    """Add this concern's commands to ``cli``."""
    cli.add_command(probe_cmd)
    cli.add_command(kio_cmd)
    cli.add_command(engines_cmd)
    cli.add_command(surface_group)
