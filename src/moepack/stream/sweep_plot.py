"""The plot of ``replay --sweep``: hit rate and fetch-limited tokens/s against cache size,
one line per policy."""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..safeio import write_bytes_atomic  # noqa: E402
from .sweep import SweepPoint  # noqa: E402


def sweep_png(points: list[SweepPoint], title: str) -> bytes:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in dict.fromkeys(p.policy for p in points):
        mine = [p for p in points if p.policy == name]
        gib = [p.cache_bytes / 2**30 for p in mine]
        ax1.plot(gib, [100 * p.rates.lifetime for p in mine], marker="o", label=name)
        tps = [p.tokens_per_second for p in mine]
        if all(t is not None for t in tps):
            ax2.plot(gib, tps, marker="o", label=name)
    ax1.set_xlabel("cache (GiB)")
    ax1.set_ylabel("hit rate, all tokens (%)")
    ax2.set_xlabel("cache (GiB)")
    ax2.set_ylabel("fetch-limited tokens/s (measured GB/s)")
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def write_sweep_png(points: list[SweepPoint], title: str, path: Path) -> Path:
    write_bytes_atomic(path, sweep_png(points, title))
    return path
