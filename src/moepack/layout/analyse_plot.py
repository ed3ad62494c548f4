"""The plot of ``analyse --plot``: per-layer speedup of each layout, and predicted against
measured speedup when the layouts were replayed."""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..safeio import write_bytes_atomic  # noqa: E402

if TYPE_CHECKING:
    from .analyse import AnalyseResult


def speedup_png(result: AnalyseResult) -> bytes:
    """One PNG: bars of predicted speedup per layer and layout (measured per layer as dots on
    them when replayed); beside it, predicted against measured speedup per layout."""
    others = [n for n in result.layouts if n != "identity"]
    measured = bool(result.replays)
    fig, axes = plt.subplots(1, 2 if measured else 1, figsize=(12 if measured else 8, 4))
    ax = axes[0] if measured else axes
    blocks = [r.block for r in result.rows]
    width = 0.8 / max(1, len(others))
    for i, name in enumerate(others):
        xs = [j + i * width for j in range(len(blocks))]
        bars = ax.bar(xs, [r.speedup(name) for r in result.rows], width, label=name)
        if measured:
            got = [r.measured_speedup(name) for r in result.rows]
            ax.scatter(
                [x for x, g in zip(xs, got, strict=True) if g is not None],
                [g for g in got if g is not None],
                color=bars.patches[0].get_facecolor() if bars.patches else None,
                edgecolors="black",
                marker="o",
                zorder=3,
            )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(blocks))], [str(b) for b in blocks])
    ax.set_xlabel("block")
    ax.set_ylabel("speedup over identity")
    ax.set_title(
        "per layer: bars predicted, dots measured" if measured else "per layer, predicted",
        fontsize=10,
    )
    ax.legend(fontsize="small")
    if measured:
        ax2 = axes[1]
        pred = [result.replay_predicted_speedup(n) or result.speedup(n) for n in others]
        meas = [result.measured_speedup(n) or 0.0 for n in others]
        ax2.scatter(pred, meas)
        for n, x, y in zip(others, pred, meas, strict=True):
            ax2.annotate(n, (x, y), fontsize="small")
        top = max([1.0, *pred, *meas]) * 1.1
        ax2.plot([0, top], [0, top], color="grey", linewidth=0.8)
        ax2.set_title("per layout, all blocks", fontsize=10)
        ax2.set_xlabel("predicted speedup")
        ax2.set_ylabel("measured speedup")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def write_speedup_plot(result: AnalyseResult, path: Path) -> Path:
    return write_bytes_atomic(path, speedup_png(result), (result.model,))
