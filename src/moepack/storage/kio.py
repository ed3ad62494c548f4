"""``kio``: which read path is fastest on this device, by how much, and at what cache cost.

Runs every engine in every mode the filesystem serves, at one or more request sizes and queue
depths, each cell cold (see ``measure``) and several times, interleaved with the others (a
shared device drifts within seconds; one run per cell made a ranking of noise). Each cell
keeps its median and its spread (slowest and fastest run). Then it derives the comparisons a
user asks for: the gain over queue depth 1, sliding window vs batch-and-drain, what
RWF_DONTCACHE costs and how much of what it read stays cached, thrash (the kernel evicting
corpus pages mid-cell), and a recommendation with its margin over the runner-up — a tie
whenever the two cells' spreads overlap.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BadInput
from ..progress import NULL_PROGRESS, ProgressSink
from .corpus import ensure_corpus
from .device import describe_device
from .engine import ReadEngine, all_engines, check_depths
from .linux import PAGE_SIZE
from .measure import (
    CellResult,
    alignment_problem,
    check_cell_seconds,
    check_repeats,
    check_request_sizes,
    measure_interleaved,
    spreads_overlap,
)
from .modes import Mode, ModeUnsupported, OpenFile, open_file
from .probe import GiB, KiB, MiB, cache_warnings, direct_from_memory

DEFAULT_SIZES = [64 * KiB, 1 * MiB]
DEFAULT_DEPTHS = [1, 8, 32]
DEFAULT_CELL_SECONDS = 0.3
DEFAULT_REPEATS = 3  # 44 cells x 3 interleaved runs x 0.3 s: about a minute
DEFAULT_CORPUS = 2 * GiB
THRASH_SHARE = 0.01  # evictions above this share of the pages a cell read count as thrash


@dataclass
class KioRow:
    engine: str
    mode: str
    request_bytes: int
    queue_depth: int
    cell: CellResult
    ratio_qd1: float | None  # GB/s over pread at QD 1 in the same mode and size

    @property
    def gbps(self) -> float:
        return self.cell.gbps


@dataclass
class Skipped:
    what: str  # "mode" or "engine"
    name: str
    reason: str


@dataclass
class WindowComparison:
    mode: str
    request_bytes: int
    queue_depth: int
    sliding_gbps: float
    batch_gbps: float
    gain: float  # sliding / batch - 1 (medians)
    within_noise: bool  # the two cells' ranges over their runs overlap


@dataclass(kw_only=True)
class DontcacheCost:
    engine: str
    request_bytes: int
    queue_depth: int
    buffered_gbps: float
    dontcache_gbps: float
    cost: float  # 1 - dontcache / buffered (positive = slower)
    buffered_residency: float | None  # share of the bytes read still cached afterwards
    dontcache_residency: float | None
    within_noise: bool  # the two cells' ranges over their runs overlap


@dataclass
class Recommendation:
    request_bytes: int
    engine: str
    mode: str
    queue_depth: int
    gbps: float
    runner_up: str | None
    runner_up_gbps: float | None
    margin: float | None  # best / runner-up - 1 (medians)
    tie: bool  # the ranges of the two over their runs overlap: no clear winner
    best_range_gbps: tuple[float, float] = (0.0, 0.0)  # slowest, fastest run
    runner_up_range_gbps: tuple[float, float] | None = None
    cache_note: str | None = None  # what the winner leaves in the page cache


@dataclass
class KioReport:
    device: dict[str, Any]
    corpus: Path
    corpus_bytes: int
    corpus_created: bool
    cell_seconds: float
    repeats: int
    rows: list[KioRow]
    skipped: list[Skipped] = field(default_factory=list)
    windows: list[WindowComparison] = field(default_factory=list)
    dontcache: list[DontcacheCost] = field(default_factory=list)
    recommendations: list[Recommendation] = field(default_factory=list)
    thrash: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _plan(
    engines: dict[str, ReadEngine], modes: list[Mode], sizes: list[int], depths: list[int]
) -> list[tuple[Mode, ReadEngine, int, int]]:
    plan = []
    have_pread = "pread" in engines
    for mode in modes:
        for eng in engines.values():
            if mode not in eng.modes:
                continue
            if eng.max_depth == 1:
                eng_depths = [1]
            else:
                eng_depths = [d for d in depths if not (d == 1 and have_pread)] or depths
            for size in sizes:
                for qd in eng_depths:
                    plan.append((mode, eng, size, qd))
    return plan


def run_kio(
    directory: str | os.PathLike[str],
    *,
    sizes: list[int] | None = None,
    depths: list[int] | None = None,
    engines: list[str] | None = None,
    modes: list[Mode] | None = None,
    cell_seconds: float = DEFAULT_CELL_SECONDS,
    corpus_bytes: int = DEFAULT_CORPUS,
    progress: ProgressSink = NULL_PROGRESS,
    repeats: int = DEFAULT_REPEATS,
) -> KioReport:
    """Compare read engines and modes on the device holding ``directory``; every cell runs
    ``repeats`` times, interleaved with the others, and reports its median and spread."""
    sizes = sorted(set(sizes or DEFAULT_SIZES))
    depths = sorted(set(depths or DEFAULT_DEPTHS))
    modes = list(dict.fromkeys(modes or list(Mode)))
    check_request_sizes(sizes)
    check_depths(depths)
    check_cell_seconds(cell_seconds)
    check_repeats(repeats)
    known = all_engines()
    chosen = engines or list(known)
    unknown = [e for e in chosen if e not in known]
    if unknown:
        raise BadInput(f"unknown engine {unknown[0]!r}; choose from {', '.join(known)}")
    skipped: list[Skipped] = []
    usable: dict[str, ReadEngine] = {}
    for name in chosen:
        reason = known[name].unavailable_reason()
        if reason:
            skipped.append(Skipped("engine", name, reason))
        else:
            usable[name] = known[name]
    corpus = ensure_corpus(directory, corpus_bytes, progress)
    if max(sizes) > corpus.size:
        raise BadInput(
            f"the largest request ({max(sizes):,} B) exceeds the corpus ({corpus.size:,} B)"
        )
    files: dict[Mode, OpenFile] = {}
    try:
        for mode in modes:
            try:
                files[mode] = open_file(corpus.path, mode)
            except ModeUnsupported as e:
                skipped.append(Skipped("mode", mode.value, e.message))
        for mode, f in files.items():
            bad = [s for s in sizes if s % f.offset_align]
            if bad:
                skipped.append(Skipped("mode", mode.value, alignment_problem(bad, f.offset_align)))
        plan = [
            p
            for p in _plan(usable, list(files), sizes, depths)
            if p[2] % files[p[0]].offset_align == 0
        ]
        if not plan:
            why = "; ".join(f"{s.what} {s.name}: {s.reason}" for s in skipped)
            raise BadInput(
                "nothing to measure: "
                + (why or "none of the chosen engines reads in the chosen modes"),
                corpus.path if why else None,
            )
        progress.start("kio", len(plan) * repeats, unit="runs")
        try:
            cells = measure_interleaved(
                [(files[mode], eng, size, qd) for mode, eng, size, qd in plan],
                cell_seconds,
                repeats,
                progress,
            )
        finally:
            progress.finish()
    finally:
        for f in files.values():
            f.close()
    report = KioReport(
        device=asdict(describe_device(corpus.path)),
        corpus=corpus.path,
        corpus_bytes=corpus.size,
        corpus_created=corpus.created,
        cell_seconds=cell_seconds,
        repeats=repeats,
        rows=_rows(cells),
        skipped=skipped,
    )
    report.windows = _windows(report.rows)
    report.dontcache = _dontcache(report.rows)
    report.recommendations = _recommend(report.rows, sizes)
    report.thrash = _thrash(cells)
    device = describe_device(corpus.path)
    for mode in files:
        mine = [c for c in cells if c.mode == mode.value]
        report.warnings += cache_warnings(mine, corpus.size, mode)
        from_memory = direct_from_memory(mine, corpus.size, mode, device)
        if from_memory:
            report.warnings.append(from_memory)
    return report


def _rows(cells: list[CellResult]) -> list[KioRow]:
    base: dict[tuple[str, int], float] = {}
    for c in cells:
        if c.queue_depth == 1 and (c.engine == "pread" or (c.mode, c.request_bytes) not in base):
            base[(c.mode, c.request_bytes)] = c.bytes_per_sec
    rows = []
    for c in cells:
        b = base.get((c.mode, c.request_bytes))
        rows.append(
            KioRow(
                c.engine,
                c.mode,
                c.request_bytes,
                c.queue_depth,
                c,
                c.bytes_per_sec / b if b else None,
            )
        )
    return rows


def _index(rows: list[KioRow]) -> dict[tuple[str, str, int, int], KioRow]:
    return {(r.engine, r.mode, r.request_bytes, r.queue_depth): r for r in rows}


def _windows(rows: list[KioRow]) -> list[WindowComparison]:
    idx = _index(rows)
    out = []
    for r in rows:
        if r.engine != "uring":
            continue
        b = idx.get(("uring-batch", r.mode, r.request_bytes, r.queue_depth))
        if b and b.gbps > 0:
            out.append(
                WindowComparison(
                    r.mode,
                    r.request_bytes,
                    r.queue_depth,
                    r.gbps,
                    b.gbps,
                    r.gbps / b.gbps - 1,
                    spreads_overlap(r.cell, b.cell),
                )
            )
    return out


def _dontcache(rows: list[KioRow]) -> list[DontcacheCost]:
    idx = _index(rows)
    out = []
    for r in rows:
        if r.mode != Mode.DONTCACHE.value:
            continue
        b = idx.get((r.engine, Mode.BUFFERED.value, r.request_bytes, r.queue_depth))
        if b and b.gbps > 0:
            out.append(
                DontcacheCost(
                    engine=r.engine,
                    request_bytes=r.request_bytes,
                    queue_depth=r.queue_depth,
                    buffered_gbps=b.gbps,
                    dontcache_gbps=r.gbps,
                    cost=1 - r.gbps / b.gbps,
                    buffered_residency=b.cell.residency,
                    dontcache_residency=r.cell.residency,
                    within_noise=spreads_overlap(r.cell, b.cell),
                )
            )
    return out


def _recommend(rows: list[KioRow], sizes: list[int]) -> list[Recommendation]:
    out = []
    for size in sizes:
        cands = sorted((r for r in rows if r.request_bytes == size), key=lambda r: -r.gbps)
        if not cands:
            continue
        best = cands[0]
        other = next((r for r in cands if (r.engine, r.mode) != (best.engine, best.mode)), None)
        margin = best.gbps / other.gbps - 1 if other and other.gbps > 0 else None
        out.append(
            Recommendation(
                request_bytes=size,
                engine=best.engine,
                mode=best.mode,
                queue_depth=best.queue_depth,
                gbps=best.gbps,
                runner_up=(
                    f"{other.engine} {Mode(other.mode).label} QD{other.queue_depth}"
                    if other
                    else None
                ),
                runner_up_gbps=other.gbps if other else None,
                margin=margin,
                tie=other is not None and spreads_overlap(best.cell, other.cell),
                cache_note=_cache_note(best),
                best_range_gbps=(best.cell.low / 1e9, best.cell.high / 1e9),
                runner_up_range_gbps=(other.cell.low / 1e9, other.cell.high / 1e9)
                if other
                else None,
            )
        )
    return out


def _cache_note(row: KioRow) -> str | None:
    res = row.cell.residency
    if row.mode != Mode.BUFFERED.value or res is None:
        return None
    return (
        f"it leaves {res * 100:.0f}% of what it reads in the page cache; DONTCACHE or O_DIRECT "
        "keep the cache for other data"
    )


def _thrash(cells: list[CellResult]) -> list[str]:
    out = []
    for c in cells:
        if c.evicted_pages and c.evicted_pages * PAGE_SIZE > THRASH_SHARE * c.bytes:
            out.append(
                f"{c.engine} {Mode(c.mode).label} {c.request_bytes:,} B QD{c.queue_depth}: the "
                f"kernel evicted {c.evicted_pages:,} corpus pages while the cell ran (memory "
                "pressure: cached reads are pushing each other out)"
            )
    return out
