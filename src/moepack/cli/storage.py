"""CLI for storage: ``probe``, ``kio`` and ``surface show|convert|plot`` (``engines`` has its own
module, so that it imports no measuring code).

Parsing and rendering only; ``moepack.storage`` measures and returns result objects.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, TypedDict

import click
from rich.console import Console

from ..errors import BadInput
from ..progress import ProgressSink
from ..storage import kio as kio_mod
from ..storage import probe as probe_mod
from ..storage.corpus import remove_corpus
from ..storage.modes import Mode
from ..storage.probe_files import probe_to_files
from ..storage.surface import FORMAT_NAME, PEER_FORMAT, Surface
from ..storage.surface_files import convert_surface, plot_surface, query_surface
from ..storage.units import format_size
from .options import (
    ListType,
    PointType,
    force_option,
    grid_options,
    input_path,
    json_option,
    measure_options,
    mode_choice,
    path_out,
    quiet_option,
)
from .render import RichProgress, emit, human_bytes, print_wide, put, styled, table, warn


def _f(v: float | None, fmt: str = "{:.3f}") -> str:
    return "–" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v)


def _range(low: float | None, high: float | None) -> str:
    """A cell's spread over its runs, in GB/s."""
    if low is None or high is None:
        return "–"
    return f"{low / 1e9:.3f}–{high / 1e9:.3f}"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v * 100:+.1f}%"


def _device_line(dev: dict[str, Any]) -> str:
    parts = [dev.get("block_device") or dev.get("source"), dev.get("model"), dev.get("filesystem")]
    return ", ".join(str(p) for p in parts if p) + f"; kernel {dev.get('kernel')}"


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
    print_wide(console, table(title, cols, rows, right=set(range(1, len(cols)))))


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
        ]
        for c in s.cells
    ]
    cols = [
        "size",
        "QD",
        "GB/s",
        "range",
        "runs",
        "IOPS",
        "p50 µs",
        "p99 µs",
        "CPU s/GB",
        "requests",
    ]
    print_wide(console, table("cells", cols, rows, right=set(range(1, len(cols)))))


class _Measure(TypedDict):
    """The keywords ``probe_to_files`` and ``run_kio`` both take for one measurement grid."""

    sizes: list[int] | None
    depths: list[int] | None
    cell_seconds: float
    corpus_bytes: int
    progress: ProgressSink
    repeats: int


def _measured(
    sizes: list[int] | None,
    depths: list[int] | None,
    cell_seconds: float,
    repeats: int,
    corpus_size: int,
    quiet: bool,
) -> _Measure:
    """The values of ``grid_options`` and ``measure_options`` as the library's keywords."""
    return _Measure(
        sizes=sizes,
        depths=depths,
        cell_seconds=cell_seconds,
        corpus_bytes=corpus_size,
        progress=RichProgress(not quiet),
        repeats=repeats,
    )


@click.command("probe")
@click.argument("target", type=input_path)
@click.option("--engine", "-e", help="Read engine (default: uring, else threads). See `engines`.")
@click.option(
    "--mode",
    "-m",
    type=mode_choice(),
    default="direct",
    show_default=True,
    help="direct = O_DIRECT; buffered and dontcache start each cell with the file's pages dropped.",
)
@grid_options(
    "Request sizes, e.g. 4K,64K,1M (default 4K…32M).", "Queue depths, e.g. 1,8,32 (default 1…64)."
)
@measure_options(
    probe_mod.DEFAULT_CELL_SECONDS,
    probe_mod.DEFAULT_REPEATS,
    probe_mod.DEFAULT_CORPUS,
    corpus_help="Size of the corpus made when TARGET is a folder (default 2G).",
    repeats_help="Runs of each cell, interleaved; the surface keeps their median.",
)
@click.option("--out", "-o", type=path_out, help="Write the surface here.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice([FORMAT_NAME, PEER_FORMAT]),
    default=FORMAT_NAME,
    show_default=True,
    help="Surface file format (potatomaxx = the peer tool's probe JSON).",
)
@click.option("--png", type=path_out, help="Also draw the surface as a heatmap.")
@click.option("--cells", "show_cells", is_flag=True, help="Also list every cell (latency, CPU).")
@json_option
@quiet_option
@force_option
def probe_cmd(
    target: Path,
    engine: str | None,
    mode: str,
    sizes: list[int] | None,
    depths: list[int] | None,
    cell_seconds: float,
    repeats: int,
    corpus_size: int,
    out: Path | None,
    fmt: str,
    png: Path | None,
    show_cells: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    """Measure the read bandwidth surface (request size × queue depth) of TARGET's device.

    TARGET is a folder (a corpus file is created there once and reused) or an existing file,
    e.g. the model itself, which is only read (the pages of it that were cached are read back
    afterwards). Every cell starts cold and runs --repeats times, interleaved with the others.
    """
    result = probe_to_files(
        target,
        out,
        fmt,
        png,
        engine=engine,
        mode=Mode(mode),
        **_measured(sizes, depths, cell_seconds, repeats, corpus_size, quiet),
    )
    written = result.written
    warn(result.warnings)

    def render(console: Console, r: probe_mod.ProbeResult) -> None:
        s = r.surface
        console.print(f"device: {_device_line(s.device or {})}")
        console.print(
            f"file: {r.target}"
            + (" (corpus created)" if r.corpus_created else "")
            + f"; engine {s.engine}, {Mode(s.mode or 'direct').label}, {s.cell_seconds:g} s/run, "
            f"{repeats} interleaved runs per cell"
        )
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

    emit(result, as_json, render)


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
                row.engine,
                Mode(row.mode).label,
                format_size(row.request_bytes),
                row.queue_depth,
                _f(row.gbps),
                _range(c.bytes_per_sec_low, c.bytes_per_sec_high),
                _f(row.ratio_qd1, "{:.2f}×"),
                _f(c.iops, "{:,.0f}"),
                _f(c.lat_p50_us, "{:,.0f}"),
                _f(c.lat_p99_us, "{:,.0f}"),
                _f(c.cpu_sec_per_gb, "{:.2f}"),
                "–" if res is None or row.mode == Mode.DIRECT.value else f"{res * 100:.0f}%",
            ]
        )
    cols = [
        "engine",
        "mode",
        "size",
        "QD",
        "GB/s",
        "range",
        "×QD1",
        "IOPS",
        "p50 µs",
        "p99 µs",
        "CPU s/GB",
        "cached",
    ]
    print_wide(console, table("read paths", cols, rows, right=set(range(3, len(cols)))))
    if r.windows:
        print_wide(
            console,
            table(
                "io_uring: sliding window vs batch-and-drain",
                ["mode", "size", "QD", "sliding GB/s", "batch GB/s", "sliding gain", "verdict"],
                [
                    [
                        Mode(w.mode).label,
                        format_size(w.request_bytes),
                        w.queue_depth,
                        _f(w.sliding_gbps),
                        _f(w.batch_gbps),
                        _pct(w.gain),
                        "within noise"
                        if w.within_noise
                        else ("sliding faster" if w.gain > 0 else "batch faster"),
                    ]
                    for w in r.windows
                ],
                right={2, 3, 4, 5},
            ),
        )
    if r.dontcache:
        print_wide(
            console,
            table(
                "RWF_DONTCACHE vs buffered: speed, and share of the bytes read left in the cache",
                [
                    "engine",
                    "size",
                    "QD",
                    "buffered GB/s",
                    "DONTCACHE GB/s",
                    "change",
                    "buffered cached",
                    "DONTCACHE cached",
                ],
                [
                    [
                        d.engine,
                        format_size(d.request_bytes),
                        d.queue_depth,
                        _f(d.buffered_gbps),
                        _f(d.dontcache_gbps),
                        _pct(-d.cost) + (" (noise)" if d.within_noise else ""),
                        _f(d.buffered_residency and d.buffered_residency * 100, "{:.0f}%"),
                        _f(d.dontcache_residency and d.dontcache_residency * 100, "{:.0f}%"),
                    ]
                    for d in r.dontcache
                ],
                right={2, 3, 4, 5, 6, 7},
            ),
        )
    for s in r.skipped:
        put(console, styled(f"skipped {s.what} {s.name}:", "yellow"), f" {s.reason}")
    for t in r.thrash:
        put(console, styled("thrash:", "red"), f" {t}")
    if not r.thrash and r.dontcache:
        console.print("no thrash: the kernel evicted no corpus pages during any cell")
    for rec in r.recommendations:
        head = styled(f"recommend for {format_size(rec.request_bytes)} reads:", "bold")
        line = f" {rec.engine} {Mode(rec.mode).label} at QD {rec.queue_depth} — {rec.gbps:.3f} GB/s"
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
        put(console, head, line)


@click.command("kio")
@click.argument("directory", type=input_path)
@grid_options("Request sizes (default 64K,1M).", "Queue depths (default 1,8,32).")
@click.option("--engines", type=ListType("str"), help="Engines to compare (default: all).")
@click.option(
    "--modes", type=ListType("str"), help="Modes: direct, buffered, dontcache (default: all)."
)
@measure_options(
    kio_mod.DEFAULT_CELL_SECONDS,
    kio_mod.DEFAULT_REPEATS,
    kio_mod.DEFAULT_CORPUS,
    corpus_help="Size of the corpus file in DIRECTORY (default 2G; created once, then reused).",
    repeats_help="Runs of each cell, interleaved; tables show median and range.",
)
@click.option(
    "--remove-corpus",
    "remove_corpus_only",
    is_flag=True,
    help="Delete the corpus in DIRECTORY and exit (no run).",
)
@json_option
@quiet_option
def kio_cmd(
    directory: Path,
    sizes: list[int] | None,
    depths: list[int] | None,
    engines: list[str] | None,
    modes: list[str] | None,
    cell_seconds: float,
    repeats: int,
    corpus_size: int,
    remove_corpus_only: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    """Compare read engines and modes on DIRECTORY's device: GB/s, latency, CPU, cache cost.

    Every cell starts cold (pages dropped with fadvise, residency checked with cachestat) and
    runs --repeats times, interleaved with the others; a winner must beat the runner-up in
    every run. A default run takes about a minute once the 2 GiB corpus exists.
    """
    if remove_corpus_only:
        gone = remove_corpus(directory)
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
        directory,
        engines=engines,
        modes=mode_list,
        **_measured(sizes, depths, cell_seconds, repeats, corpus_size, quiet),
    )
    warn(report.warnings)
    emit(report, as_json, _render_kio)


# -- surface files -------------------------------------------------------------------------


@click.command("show")
@click.argument("file", type=input_path)
@click.option(
    "--at",
    "points",
    type=PointType(),
    multiple=True,
    help="Predict bandwidth at a request size and depth, e.g. --at 864K@8 (repeatable).",
)
@click.option("--cells", "show_cells", is_flag=True, help="Also list every cell (latency, CPU).")
@json_option
def surface_show_cmd(
    file: Path, points: tuple[tuple[int, int], ...], show_cells: bool, as_json: bool
) -> None:
    """Print a surface; with --at, the interpolated bandwidth at those points."""
    query = query_surface(file, points)
    s, answers = query.surface, query.predictions

    def render(console: Console, _: Any) -> None:
        fmt_name = (
            "moepack surface v1" if s.source_format == FORMAT_NAME else "potatomaxx probe JSON"
        )
        console.print(f"{file}: {fmt_name}, {len(s.cells)} cells")
        if s.device:
            console.print(f"device: {_device_line(s.device)}")
        meta = [
            f"{k} {v}"
            for k, v in (("engine", s.engine), ("mode", s.mode), ("measured", s.created))
            if v
        ]
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

    emit(query, as_json, render)


@click.command("convert")
@click.argument("src", type=input_path)
@click.argument("dest", type=path_out)
@click.option(
    "--to",
    "fmt",
    type=click.Choice([FORMAT_NAME, PEER_FORMAT]),
    required=True,
    help="Format to write.",
)
@json_option
@force_option
def surface_convert_cmd(src: Path, dest: Path, fmt: str, as_json: bool) -> None:
    """Rewrite a surface file in the other format (potatomaxx keeps only size, depth, GB/s)."""
    emit(
        convert_surface(src, dest, fmt),
        as_json,
        lambda con, r: con.print(f"wrote {r.written} ({r.format}, {r.cells} cells)"),
    )


@click.command("plot")
@click.argument("src", type=input_path)
@click.argument("png", type=path_out)
@click.option("--title", help="Title above the heatmap.")
@json_option
@force_option
def surface_plot_cmd(src: Path, png: Path, title: str | None, as_json: bool) -> None:
    """Draw a surface file as a heatmap PNG."""
    emit(
        plot_surface(src, png, title),
        as_json,
        lambda con, r: con.print(f"wrote {r.written}"),
    )
