"""The storage a model streams from, measured once per device and kept in the user's cache.

Three measurements, each of the read path one runner uses:

- the **surface** (``storage.probe``, buffered reads through the thread engine, cold cells):
  request size x queue depth, read at the model's expert slice size and the prefetcher's
  queue depth for the page-cache prefetcher;
- the **direct surface** (the same probe with ``O_DIRECT``, requests up to 1 MiB): what the
  pager's reader threads get (``O_DIRECT``, at most 1 MiB a read, ``--qd`` deep); where the
  filesystem refuses ``O_DIRECT`` the pager reads buffered, and so does the estimate;
- **faults** (stock llama.cpp reads experts by page faults on its map): cold slices of each
  size touched page by page through a map of the file, as a matmul reads them. Per slice: the
  time it took and the bytes the kernel brought in (its fault read-around, cachestat), which
  is what a miss costs stock llama.cpp on this kernel and device.

Both are stored under ``<cache>/fit/storage-<device>.json``, keyed by the device holding the
file probed (block device, model, filesystem, mount), and reused until ``remeasure``.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..cachedir import cache_dir
from ..errors import BadInput
from ..pages import drop_cached
from ..progress import NULL_PROGRESS, ProgressSink
from ..storage.device import describe_device
from ..storage.linux import PAGE_SIZE, cachestat, resident_ranges, will_need
from ..storage.modes import Mode, ModeUnsupported
from ..storage.probe import run_probe
from ..storage.surface import Surface

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB]
DEPTHS = [1, 2, 8]
DIRECT_SIZES = [64 * KiB, 256 * KiB, 1 * MiB]
DIRECT_DEPTHS = [1, 8]
PAGER_READ = 1 * MiB  # the pager's largest read (pager.c)
FORMAT = "moepack-fit-storage/2"
"""Version 2 added the direct surface; a profile of version 1 is measured again."""
OLDER = ("moepack-fit-storage/1",)


@dataclass(frozen=True)
class FaultCell:
    """Cold slices of ``slice_bytes`` touched through a map: seconds and bytes per slice."""

    slice_bytes: int
    seconds: float  # median per slice
    bytes_read: float  # mean bytes the kernel brought in per slice

    @property
    def bandwidth(self) -> float:
        return self.bytes_read / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class StorageProfile:
    device: dict[str, Any]
    key: str
    surface: Surface
    faults: list[FaultCell]
    read_ahead_kb: int | None
    measured: str
    probed: str  # the file measured
    cached: bool = False  # read from the cache, not measured now
    direct: Surface | None = None  # O_DIRECT reads (None: the filesystem refuses them)

    def fault(self, slice_bytes: int) -> FaultCell:
        """The fault cell at ``slice_bytes``, interpolated in log size between cells."""
        cells = sorted(self.faults, key=lambda c: c.slice_bytes)
        if slice_bytes <= cells[0].slice_bytes:
            c = cells[0]  # a smaller slice still costs the fault's read-around
            return FaultCell(slice_bytes, c.seconds, c.bytes_read)
        for a, b in zip(cells, cells[1:], strict=False):
            if a.slice_bytes <= slice_bytes <= b.slice_bytes:
                w = math.log(slice_bytes / a.slice_bytes) / math.log(b.slice_bytes / a.slice_bytes)
                return FaultCell(
                    slice_bytes,
                    a.seconds + w * (b.seconds - a.seconds),
                    a.bytes_read + w * (b.bytes_read - a.bytes_read),
                )
        c = cells[-1]
        scale = slice_bytes / c.slice_bytes
        return FaultCell(slice_bytes, c.seconds * scale, c.bytes_read * scale)

    def bandwidth(self, request_bytes: int, queue_depth: int) -> float:
        return self.surface.bandwidth(max(request_bytes, PAGE_SIZE), queue_depth)

    def pager_bandwidth(self, slice_bytes: int, queue_depth: int) -> float:
        """What the pager's readers get on a slice of ``slice_bytes``: ``O_DIRECT`` reads of
        at most ``PAGER_READ`` each, ``queue_depth`` at once (buffered where the filesystem
        refuses ``O_DIRECT``, as the pager then reads)."""
        request = max(PAGE_SIZE, min(slice_bytes, PAGER_READ))
        surface = self.direct if self.direct is not None else self.surface
        return surface.bandwidth(request, queue_depth)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "device": self.device,
            "key": self.key,
            "surface": self.surface.to_json(),
            "faults": [asdict(c) for c in self.faults],
            "read_ahead_kb": self.read_ahead_kb,
            "measured": self.measured,
            "probed": self.probed,
            "cached": self.cached,
            "direct": self.direct.to_json() if self.direct is not None else None,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any], origin: str) -> StorageProfile:
        try:
            if doc.get("format") != FORMAT:
                raise ValueError(f"format {doc.get('format')!r}")
            return cls(
                device=dict(doc["device"]),
                key=str(doc["key"]),
                surface=Surface.from_json(doc["surface"], origin),
                faults=[FaultCell(**c) for c in doc["faults"]],
                read_ahead_kb=doc.get("read_ahead_kb"),
                measured=str(doc["measured"]),
                probed=str(doc["probed"]),
                cached=True,
                direct=Surface.from_json(doc["direct"], origin) if doc.get("direct") else None,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise BadInput(f"not a storage measurement fit wrote ({e})", origin) from None


def device_key(path: Path) -> tuple[str, dict[str, Any]]:
    """A name for the device holding ``path`` and what identifies it."""
    d = describe_device(path)
    ident = {
        "block_device": d.block_device,
        "model": d.model,
        "filesystem": d.filesystem,
        "mount_point": d.mount_point,
        "source": d.source,
    }
    h = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return h, ident


def _read_ahead_kb(device: dict[str, Any]) -> int | None:
    name = device.get("block_device")
    if not name:
        return None
    try:
        return int((Path("/sys/block") / str(name) / "queue" / "read_ahead_kb").read_text())
    except (OSError, ValueError):
        return None


def _drop_clean(fd: int) -> None:
    """Drop the file's pages, writing back dirty ones first (a file just written keeps its
    dirty pages cached through a drop)."""
    if cachestat(fd, 0, 0).nr_dirty:
        os.fdatasync(fd)
    drop_cached(fd)


def measure_faults(path: Path, sizes: list[int], slices: int, seed: int = 0) -> list[FaultCell]:
    """Cold slices of each size at random places of ``path``, touched page by page through a
    map: what a page-faulting reader (stock llama.cpp) pays per slice."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    rng = random.Random(seed)
    out = []
    try:
        mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        try:
            for s in sizes:
                room = (size - s) // PAGE_SIZE
                if room <= 0:
                    continue
                _drop_clean(fd)
                got = []
                t0 = time.perf_counter()
                for _ in range(slices):
                    off = rng.randrange(room) * PAGE_SIZE
                    before = cachestat(fd, 0, 0).nr_cache
                    touched = 0
                    for p in range(off, off + s, PAGE_SIZE):
                        touched += mm[p]
                    got.append((cachestat(fd, 0, 0).nr_cache - before) * PAGE_SIZE)
                # back to back, as a decode's faults come: each waits for the read-around
                # of the ones before it where the device is still busy with them
                seconds = (time.perf_counter() - t0) / slices
                out.append(FaultCell(s, seconds, statistics.fmean(got)))
            mm.madvise(mmap.MADV_DONTNEED)
        finally:
            mm.close()
        drop_cached(fd)
    finally:
        os.close(fd)
    return out


def measure_storage(
    target: Path,
    *,
    sizes: list[int] | None = None,
    depths: list[int] | None = None,
    cell_seconds: float = 0.2,
    repeats: int = 2,
    corpus_bytes: int = 1 * GiB,
    fault_slices: int = 24,
    progress: ProgressSink = NULL_PROGRESS,
) -> StorageProfile:
    """Measure the surface and the fault costs on ``target`` (a file, read only and its
    cached pages given back, or a folder, where a corpus is made)."""
    sizes = sizes or SIZES
    probed = target
    if target.is_file():
        cap = target.stat().st_size // 4
        sizes = [s for s in sizes if s <= cap] or [max(PAGE_SIZE, cap // PAGE_SIZE * PAGE_SIZE)]
    result = run_probe(
        target,
        engine="threads",
        mode=Mode.BUFFERED,
        sizes=sizes,
        depths=depths or DEPTHS,
        cell_seconds=cell_seconds,
        corpus_bytes=corpus_bytes,
        progress=progress,
        repeats=repeats,
    )
    probed = result.target
    fd = os.open(probed, os.O_RDONLY)
    try:
        keep = [] if result.corpus_created else resident_ranges(fd, probed.stat().st_size)
    finally:
        os.close(fd)
    faults = measure_faults(probed, sizes, fault_slices)
    # after the faults: the probe reads back what was cached before it, in the background
    direct = _direct_surface(probed, sizes, cell_seconds, repeats, progress)
    if keep:
        fd = os.open(probed, os.O_RDONLY)
        try:
            will_need(fd, keep)
        finally:
            os.close(fd)
    key, ident = device_key(probed)
    return StorageProfile(
        device=ident,
        key=key,
        surface=result.surface,
        faults=faults,
        read_ahead_kb=_read_ahead_kb(ident),
        measured=datetime.now(UTC).isoformat(timespec="seconds"),
        probed=str(probed),
        direct=direct,
    )


def _direct_surface(
    path: Path, sizes: list[int], cell_seconds: float, repeats: int, progress: ProgressSink
) -> Surface | None:
    """``O_DIRECT`` reads of ``path`` at the pager's request sizes and depths (None where the
    filesystem refuses them)."""
    wanted = sorted(
        {min(s, PAGER_READ) for s in sizes} | {s for s in DIRECT_SIZES if s <= max(sizes)}
    )
    try:
        result = run_probe(
            path,
            engine="threads",
            mode=Mode.DIRECT,
            sizes=wanted,
            depths=DIRECT_DEPTHS,
            cell_seconds=cell_seconds,
            progress=progress,
            repeats=repeats,
        )
    except ModeUnsupported:
        return None
    return result.surface


def profile_path(key: str) -> Path:
    return cache_dir() / "fit" / f"storage-{key}.json"


def storage_profile(
    target: Path, probe: bool = False, progress: ProgressSink = NULL_PROGRESS, **measure: Any
) -> StorageProfile:
    """The device's profile from the cache, or measured now (and cached) when there is none
    or ``probe``."""
    key, _ident = device_key(target if target.exists() else target.parent)
    path = profile_path(key)
    if path.exists() and not probe:
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise BadInput(
                f"unreadable storage measurement ({e}); `probe` measures it again", path
            ) from None
        if not (isinstance(doc, dict) and doc.get("format") in OLDER):
            return StorageProfile.from_json(doc, str(path))
    profile = measure_storage(target, progress=progress, **measure)
    save_json(path, profile.to_json())
    return profile


def save_json(path: Path, doc: dict[str, Any]) -> None:
    """Write a cache entry beside its name and switch it into place (readers never see half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1), encoding="utf-8")
    os.replace(tmp, path)
