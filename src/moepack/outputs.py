"""Writing a group of small files (a plan and its map, a surface and its heatmap) so that all
of them appear or none does, with OS errors worded the one way ``safeio`` words them."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from .safeio import AtomicOutputs, describe_os_error


def write_together(
    files: Sequence[tuple[Path, bytes]], inputs: Sequence[str | os.PathLike[str]] = ()
) -> list[Path]:
    """Write every ``(path, bytes)`` through one ``AtomicOutputs``; return the paths written."""
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
