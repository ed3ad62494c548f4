"""``surface show | convert | plot``: what the surface commands compute from and write for a
surface file."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..filekinds import IMAGE, check_output_kind
from ..safeio import check_destination, write_bytes_atomic
from .surface import Surface


@dataclass
class SurfaceQuery:
    """A surface file's contents and the interpolated bandwidth at the points asked about."""

    path: Path
    surface: Surface
    predictions: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"surface": self.surface.to_json(), "predictions": self.predictions}


def query_surface(path: Path, points: Sequence[tuple[int, int]] = ()) -> SurfaceQuery:
    """Read ``path`` and predict the bandwidth at each ``(request bytes, queue depth)``."""
    s = Surface.load(path)
    answers = [
        {"request_bytes": size, "queue_depth": qd, "bytes_per_sec": s.bandwidth(size, qd)}
        for size, qd in points
    ]
    return SurfaceQuery(path, s, answers)


@dataclass
class SurfaceWritten:
    """A surface file written from another: where, in which format or how many bytes."""

    written: str
    cells: int
    format: str | None = None
    bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"written": self.written}
        if self.format is not None:
            doc["format"] = self.format
        if self.bytes is not None:
            doc["bytes"] = self.bytes
        doc["cells"] = self.cells
        return doc


def convert_surface(src: Path, dest: Path, fmt: str) -> SurfaceWritten:
    """Rewrite the surface file ``src`` at ``dest`` in ``fmt`` (ours or the peer's)."""
    check_destination(dest, [src])
    s = Surface.load(src)
    s.save(dest, fmt, inputs=[src])
    return SurfaceWritten(str(dest), len(s.cells), format=fmt)


def plot_surface(src: Path, png: Path, title: str | None = None) -> SurfaceWritten:
    """Draw the surface file ``src`` as a heatmap PNG at ``png``."""
    from .heatmap import heatmap_png

    check_destination(png, [src])
    check_output_kind(png, IMAGE)
    s = Surface.load(src)
    data = heatmap_png(s, title)
    write_bytes_atomic(png, data, inputs=[src])
    return SurfaceWritten(str(png), len(s.cells), bytes=len(data))
