"""Which device a file lives on: block device, model, filesystem, kernel.

A surface is a property of one device and filesystem, so every surface records where it was
measured; this module finds that from ``/proc/self/mountinfo`` and ``/sys/dev/block``.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DeviceInfo:
    """Identity of the storage behind a path."""

    path: str
    mount_point: str
    filesystem: str
    source: str
    block_device: str | None
    model: str | None
    logical_block_size: int | None
    rotational: bool | None
    kernel: str


def _unescape(field: str) -> str:
    return field.encode().decode("unicode_escape") if "\\" in field else field


def _mount_of(path: Path) -> tuple[str, str, str]:
    """(mount point, filesystem type, source) of the mount holding ``path``."""
    best = ("/", "unknown", "unknown")
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return best
    target = str(path)
    best_len = -1
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        rfields = right.split()
        if len(fields) < 5 or len(rfields) < 2:
            continue
        mp = _unescape(fields[4])
        inside = target == mp or target.startswith(mp.rstrip("/") + "/")
        if inside and len(mp) >= best_len:  # later mounts shadow earlier ones
            best_len = len(mp)
            best = (mp, rfields[0], rfields[1])
    return best


def _read(p: Path) -> str | None:
    try:
        return p.read_text().strip()
    except OSError:
        return None


def _block_info(st_dev: int) -> tuple[str | None, str | None, int | None, bool | None]:
    """(name, model, logical block size, rotational) of the block device (whole disk)."""
    sys_dev = Path(f"/sys/dev/block/{os.major(st_dev)}:{os.minor(st_dev)}")
    if not sys_dev.exists():
        return None, None, None, None
    node = sys_dev.resolve()
    disk = node.parent if (node / "partition").exists() else node
    name = disk.name
    model = _read(disk / "device" / "model")
    if model is None:
        vendor = _read(disk / "device" / "vendor")
        modalias = _read(disk / "device" / "modalias") or ""
        if modalias.startswith("virtio:"):
            model = "virtio block device" + (f" (vendor {vendor})" if vendor else "")
        elif vendor:
            model = vendor
    lbs = _read(disk / "queue" / "logical_block_size")
    rot = _read(disk / "queue" / "rotational")
    return (
        name,
        model,
        int(lbs) if lbs and lbs.isdigit() else None,
        (rot == "1") if rot in ("0", "1") else None,
    )


def describe_device(path: str | os.PathLike[str]) -> DeviceInfo:
    """Find the mount, filesystem and block device behind ``path`` (file or folder)."""
    p = Path(os.path.realpath(path))
    st = os.stat(p)
    mount_point, fs, source = _mount_of(p)
    name, model, lbs, rot = _block_info(st.st_dev)
    return DeviceInfo(
        path=str(p),
        mount_point=mount_point,
        filesystem=fs,
        source=source,
        block_device=name,
        model=model,
        logical_block_size=lbs,
        rotational=rot,
        kernel=platform.release(),
    )


def block_logical_size(path: str | os.PathLike[str]) -> int | None:
    """Logical block size of the device under ``path``: O_DIRECT's fallback alignment."""
    return _block_info(os.stat(path).st_dev)[2]
