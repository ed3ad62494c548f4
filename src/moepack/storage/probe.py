"""``probe``: measure a bandwidth surface (request size x queue depth) on the user's device."""

from __future__ import annotations

import os
import stat
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..errors import BadInput
from ..progress import NULL_PROGRESS, ProgressSink
from .corpus import corpus_path, ensure_corpus
from .device import DeviceInfo, describe_device
from .engine import get_engine
from .linux import PAGE_SIZE, resident_ranges, will_need
from .measure import (
    CellResult,
    check_cell_seconds,
    check_repeats,
    check_request_sizes,
    measure_interleaved,
)
from .modes import Mode, open_file
from .surface import Surface, SurfaceCell

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_SIZES = [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 32 * MiB]
DEFAULT_DEPTHS = [1, 2, 4, 8, 16, 32, 64]
DEFAULT_CORPUS = 2 * GiB
DEFAULT_CELL_SECONDS = 0.3
DEFAULT_REPEATS = 3


@dataclass
class ProbeResult:
    surface: Surface
    cells: list[CellResult]
    target: Path
    corpus_created: bool
    warnings: list[str] = field(default_factory=list)
    cache_restored_bytes: int = 0  # of a user's file: cached before, read back afterwards
    written: list[str] = field(default_factory=list)  # files written from it (probe_files)

    def to_json(self) -> dict[str, Any]:
        return {
            "target": str(self.target),
            "corpus_created": self.corpus_created,
            "surface": self.surface.to_json(),
            "warnings": self.warnings,
            "written": self.written,
            "cache_restored_bytes": self.cache_restored_bytes,
        }


def default_engine() -> str:
    """io_uring's sliding window where the kernel allows a ring, else the thread pool."""
    return "uring" if get_engine("uring").unavailable_reason() is None else "threads"


def cache_warnings(cells: list[CellResult], file_size: int, mode: Mode) -> list[str]:
    """Say when a cached-mode result may have come from the page cache."""
    if mode is Mode.DIRECT:
        return []
    out: list[str] = []
    pages = max(1, file_size // PAGE_SIZE)
    for c in cells:
        where = f"{c.engine} {Mode(c.mode).label} {c.request_bytes:,} B QD{c.queue_depth}"
        if c.cache_pages_before is not None and c.cache_pages_before > 0.01 * pages:
            out.append(
                f"{where}: {c.cache_pages_before * 100 / pages:.0f}% of the file stayed in the "
                "page cache after dropping it (mapped or locked by another process?); the "
                "result may come from memory"
            )
        if c.exhausted and c.requests < 4 * c.queue_depth:
            out.append(
                f"{where}: the file holds too few requests of this size for a cold cell; "
                "use a larger corpus"
            )
        elif c.exhausted:
            out.append(
                f"{where}: read the whole file before the cell's time was up (ended early to "
                "stay cold); a larger corpus measures longer"
            )
    return out


def direct_from_memory(
    cells: list[CellResult], file_size: int, mode: Mode, device: DeviceInfo
) -> str | None:
    """Why O_DIRECT results may be memory speed, or ``None``.

    O_DIRECT bypasses the page cache only where a block device is behind the file. Without
    one (tmpfs, ramfs-like, some network or FUSE filesystems) check what cachestat says:
    file pages that stay cached after the drop are where the reads come from. (Btrfs and
    overlayfs report no block device either, but their pages do drop.)
    """
    if mode is not Mode.DIRECT or device.block_device is not None:
        return None
    pages = max(1, file_size // PAGE_SIZE)
    held = [c.cache_pages_before for c in cells if c.cache_pages_before is not None]
    where = f"{device.filesystem} ({device.source})"
    if not held:
        return (
            f"the file is on {where}, which has no block device, and cachestat cannot say "
            "whether it lives in memory: O_DIRECT results may be memory speed"
        )
    share = max(held) / pages
    if share <= 0.01:
        return None
    return (
        f"the file is on {where}, which has no block device, and {share * 100:.0f}% of it "
        "stays in memory after dropping the cache: O_DIRECT reads here come from RAM, not a "
        "device (the surface is not marked cache_bypassed)"
    )


def _kind(p: Path) -> str:
    """What kind of file system object ``p`` is, in words."""
    mode = p.stat().st_mode
    for test, word in (
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a pipe"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return word
    return "a special file"


def _available_memory() -> int | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _check_memory(in_flight: int) -> None:
    """Refuse a grid whose largest cell needs more buffer memory than half of what is free."""
    avail = _available_memory()
    if avail is not None and in_flight > avail // 2:
        raise BadInput(
            f"the largest cell keeps {in_flight / 2**30:.1f} GiB of reads in flight, more than "
            f"half the available memory ({avail / 2**30:.1f} GiB); lower `sizes` or `depths`"
        )


def probe_inputs(target: str | os.PathLike[str]) -> list[Path]:
    """What a probe of ``target`` reads: the file itself, or the corpus in a folder. Outputs
    must never land on these."""
    t = Path(target)
    if t.is_dir():
        return [corpus_path(t)]
    return [t] if t.exists() else []


def run_probe(
    target: str | os.PathLike[str],
    *,
    engine: str | None = None,
    mode: Mode = Mode.DIRECT,
    sizes: list[int] | None = None,
    depths: list[int] | None = None,
    cell_seconds: float = DEFAULT_CELL_SECONDS,
    corpus_bytes: int = DEFAULT_CORPUS,
    progress: ProgressSink = NULL_PROGRESS,
    repeats: int = DEFAULT_REPEATS,
) -> ProbeResult:
    """Measure every (size, depth) cell ``repeats`` times, interleaved, and keep each cell's
    median and spread. ``target`` is a folder (a corpus is made there and reused) or an
    existing file, e.g. the model itself, which is only ever read; the pages of it that were
    in the page cache before are read back afterwards (cold cells drop them)."""
    sizes = sorted(set(sizes or DEFAULT_SIZES))
    depths = sorted(set(depths or DEFAULT_DEPTHS))
    check_request_sizes(sizes)
    check_cell_seconds(cell_seconds)
    check_repeats(repeats)
    t = Path(target)
    if not t.exists():
        raise BadInput("does not exist", t)
    if not (t.is_dir() or t.is_file()):
        raise BadInput(
            f"{_kind(t)}, not a file or a folder; probe a file, or a folder to hold a corpus", t
        )
    name = engine or default_engine()
    eng = get_engine(name)
    reason = eng.unavailable_reason()
    if reason:
        raise BadInput(f"engine {name!r} cannot run here: {reason}")
    for qd in depths:
        eng.check(mode, qd)
    _check_memory(max(sizes) * (max(depths) if eng.max_depth is None else 1))
    created = False
    if t.is_dir():
        corpus = ensure_corpus(t, corpus_bytes, progress)
        path, created = corpus.path, corpus.created
    else:
        path = t
    with open_file(path, mode) as f:
        if f.size < max(sizes):
            raise BadInput(
                f"file holds {f.size:,} bytes, less than the largest request ({max(sizes):,})",
                path,
            )
        check_request_sizes(sizes, f)
        # Cold cells drop the file's pages; a user's file (the model) gets back what it had.
        keep = [] if created or t.is_dir() else resident_ranges(f.fd, f.size)
        plan = [(f, eng, size, qd) for size in sizes for qd in depths]
        progress.start(f"probe {name} {mode.label}", len(plan) * repeats, unit="runs")
        try:
            cells = measure_interleaved(plan, cell_seconds, repeats, progress)
        finally:
            progress.finish()
            restored = will_need(f.fd, keep)
        device = describe_device(path)
        dev = asdict(device)
        if f.align:
            dev["dio_mem_align"] = f.align.mem
            dev["dio_offset_align"] = f.align.offset
            dev["dio_align_source"] = f.align.source
        warnings = cache_warnings(cells, f.size, mode)
        from_memory = direct_from_memory(cells, f.size, mode, device)
        if from_memory:
            warnings.append(from_memory)
        corpus_size = f.size
    surface = Surface(
        cells=[
            SurfaceCell(
                request_bytes=c.request_bytes,
                queue_depth=c.queue_depth,
                bytes_per_sec=max(c.bytes_per_sec, 1.0),
                iops=c.iops,
                lat_p50_us=c.lat_p50_us,
                lat_p99_us=c.lat_p99_us,
                cpu_sec_per_gb=c.cpu_sec_per_gb,
                requests=c.requests,
                seconds=c.seconds,
                bytes_per_sec_low=max(c.low, 1.0),
                bytes_per_sec_high=max(c.high, 1.0),
                repeats=c.repeats,
            )
            for c in cells
        ],
        engine=name,
        mode=mode.value,
        device=dev,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        cell_seconds=cell_seconds,
        corpus_bytes=corpus_size,
        cache_bypassed=mode is Mode.DIRECT and from_memory is None,
        note=(
            f"moepack probe: engine {name}, {mode.label}, cold cells of {cell_seconds:g} s, "
            f"median of {repeats} interleaved runs"
        ),
    )
    return ProbeResult(surface, cells, Path(path), created, warnings, restored)
