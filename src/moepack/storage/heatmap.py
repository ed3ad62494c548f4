"""The surface as a heatmap PNG (GB/s per request size and queue depth), drawn with Agg."""

from __future__ import annotations

import io
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .surface import Surface  # noqa: E402


def size_label(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def heatmap_png(surface: Surface, title: str | None = None) -> bytes:
    """PNG bytes of the surface; unmeasured cells of a ragged grid are left blank."""
    sizes, depths = surface.request_sizes, surface.queue_depths
    grid = np.full((len(sizes), len(depths)), np.nan)
    for c in surface.cells:
        grid[sizes.index(c.request_bytes), depths.index(c.queue_depth)] = c.bytes_per_sec / 1e9
    fig, ax = plt.subplots(
        figsize=(1.1 * len(depths) + 2.5, 0.55 * len(sizes) + 1.8), dpi=110, layout="constrained"
    )
    im = ax.imshow(grid, cmap="viridis", aspect="auto", origin="lower")
    ax.set_xticks(range(len(depths)), [str(d) for d in depths])
    ax.set_yticks(range(len(sizes)), [size_label(s) for s in sizes])
    ax.set_xlabel("queue depth")
    ax.set_ylabel("request size")
    finite = grid[np.isfinite(grid)]
    top = float(finite.max()) if finite.size else 1.0
    for i in range(len(sizes)):
        for j in range(len(depths)):
            v = grid[i, j]
            if math.isfinite(v):
                ax.text(
                    j,
                    i,
                    f"{v:.2f}" if v < 10 else f"{v:.1f}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="black" if v > 0.6 * top else "white",
                )
    fig.colorbar(im, ax=ax, label="GB/s")
    if title is None:
        dev = surface.device or {}
        where = dev.get("block_device") or dev.get("source") or ""
        fs = dev.get("filesystem")
        mode = {"direct": "O_DIRECT", "dontcache": "DONTCACHE"}.get(
            surface.mode or "", surface.mode
        )
        parts = [p for p in (surface.engine, mode, where, fs) if p]
        title = "read bandwidth" + (f" — {', '.join(parts)}" if parts else "")
    ax.set_title(title, fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()
