"""PNG plots of ``trace stats``: popularity, reuse by lag, LRU hit rate, co-activation lift.

Drawn with matplotlib's Agg backend into memory, then written together through
``safeio.AtomicOutputs``: all four files appear, or none does.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from ..errors import BadInput  # noqa: E402
from ..safeio import AtomicOutputs, describe_os_error  # noqa: E402
from .chain import greedy_chain  # noqa: E402
from .core import RoutingTrace  # noqa: E402
from .pairs import pair_counts  # noqa: E402
from .routing_stats import MAX_LAG, RoutingStats  # noqa: E402

HEATMAP_EXPERTS = 512
"""Experts the co-activation heatmap shows at most (the most routed ones beyond that)."""


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _popularity(trace: RoutingTrace, phase: str) -> bytes:
    rng = trace.phase_rows(phase)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110, layout="constrained")
    ranks = np.arange(1, trace.n_expert + 1)
    for layer in range(trace.layers):
        ids = np.asarray(trace.ids[rng, layer, :])
        share = np.sort(np.bincount(ids.ravel(), minlength=trace.n_expert))[::-1] / ids.size
        ax.plot(ranks, share, color="tab:blue", alpha=max(0.15, 1 / trace.layers), lw=1)
    ax.axhline(1 / trace.n_expert, color="gray", ls="--", lw=1, label="uniform")
    ax.set_xlabel("expert rank (hottest first)")
    ax.set_ylabel("share of routings")
    ax.set_title(f"expert popularity per layer ({phase} tokens)", fontsize=10)
    ax.legend()
    return _png(fig)


def _phase_curves(
    stats: RoutingStats, field: str, x: np.ndarray, xlabel: str, ylabel: str, title: str
) -> tuple[Figure, Axes]:
    """One line per phase of the mean over layers of the per-layer curve ``field``."""
    fig, ax = plt.subplots(figsize=(6, 4), dpi=110, layout="constrained")
    for name, ph in stats.phases.items():
        ax.plot(x, ph.mean_curve(field), marker="o" if x.size <= 16 else "", label=f"{name} tokens")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=10)
    return fig, ax


def _reuse(stats: RoutingStats) -> bytes:
    fig, ax = _phase_curves(
        stats,
        "reuse",
        np.arange(1, MAX_LAG + 1),
        "lag (tokens)",
        "share of experts reused",
        "reuse of earlier tokens' experts (mean over layers)",
    )
    ax.axhline(stats.random_reuse, color="gray", ls="--", lw=1, label="independent (k / n)")
    ax.legend()
    return _png(fig)


def _lru(stats: RoutingStats, n_expert: int) -> bytes:
    fig, ax = _phase_curves(
        stats,
        "lru_hit_rate",
        np.arange(1, n_expert + 1),
        "LRU cache size (experts per layer)",
        "hit rate",
        "exact LRU hit rate (mean over layers)",
    )
    ax.legend()
    return _png(fig)


def _heatmap(trace: RoutingTrace, layer: int, phase: str) -> bytes:
    """Lift of every expert pair, experts in the planner's co-activation chain order (so
    clusters show as blocks on the diagonal; the file's own order would scatter them)."""
    rng = trace.phase_rows(phase)
    ids = np.asarray(trace.ids[rng, layer, :])
    counts = np.bincount(ids.ravel(), minlength=trace.n_expert)
    shown = _heatmap_experts(counts)
    m = shown.size
    lut = np.full(trace.n_expert, m, dtype=np.int64)  # experts not shown: one extra bucket
    lut[shown] = np.arange(m)
    local = lut[ids]
    both = pair_counts(local, local, m + 1)[:m, :m]
    np.fill_diagonal(both, 0)
    counts = counts[shown]
    order = greedy_chain(both, counts, trace.k)
    with np.errstate(divide="ignore", invalid="ignore"):
        lift = both.astype(np.float64) * trace.phase_tokens(phase) / np.outer(counts, counts)
    lift = lift[np.ix_(order, order)]
    lift[~np.isfinite(lift)] = np.nan
    np.fill_diagonal(lift, np.nan)
    fig, ax = plt.subplots(figsize=(6.5, 5.5), dpi=110, layout="constrained")
    im = ax.imshow(np.log2(np.where(lift > 0, lift, np.nan)), cmap="RdBu_r", vmin=-3, vmax=3)
    fig.colorbar(im, ax=ax, label="log2 lift (0 = independent, 1 = 2x)")
    ticks = np.linspace(0, m - 1, min(m, 9)).astype(int)
    ax.set_xticks(ticks, [str(shown[order[t]]) for t in ticks])
    ax.set_yticks(ticks, [str(shown[order[t]]) for t in ticks])
    ax.set_xlabel("expert (co-activation chain order)")
    ax.set_ylabel("expert")
    which = "" if m == trace.n_expert else f"; the {m} most routed of {trace.n_expert:,} experts"
    ax.set_title(f"co-activation lift, layer {layer} ({phase} tokens{which})", fontsize=10)
    return _png(fig)


def _heatmap_experts(counts: np.ndarray) -> np.ndarray:
    """The experts the heatmap shows: all of them up to ``HEATMAP_EXPERTS``, else that many of
    the most routed (an image of n² cells, and the chain over them, would grow without bound)."""
    if counts.size <= HEATMAP_EXPERTS:
        return np.arange(counts.size)
    return np.sort(np.argsort(-counts, kind="stable")[:HEATMAP_EXPERTS])


def write_stats_plots(
    stats: RoutingStats,
    trace: RoutingTrace,
    folder: str | os.PathLike[str],
    heatmap_layer: int = 0,
) -> list[Path]:
    """Write the four PNGs into ``folder`` (created if missing, its parent must exist);
    returns their paths. The heatmap shows trace layer ``heatmap_layer``."""
    out = Path(folder)
    if not 0 <= heatmap_layer < trace.layers:
        raise BadInput(
            f"heatmap layer {heatmap_layer} does not exist (0..{trace.layers - 1})", trace.path
        )
    if out.exists() and not out.is_dir():
        raise BadInput("the plot folder exists and is not a folder", out)
    phase = "decode" if "decode" in stats.phases else "all"
    images = {
        "popularity.png": _popularity(trace, phase),
        "reuse.png": _reuse(stats),
        "lru-hit-rate.png": _lru(stats, trace.n_expert),
        f"coactivation-layer{heatmap_layer}.png": _heatmap(trace, heatmap_layer, phase),
    }
    made = not out.exists()
    try:
        if made:
            out.mkdir()
        inputs = [trace.path] if trace.path is not None else []
        with AtomicOutputs(inputs) as outs:
            for name, png in images.items():
                outs.open(out / name).write(png)
    except BaseException as e:  # nothing written: take back the folder made for it
        if made and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        if isinstance(e, FileNotFoundError):
            raise BadInput("the plot folder's parent does not exist", out) from None
        if isinstance(e, OSError):
            raise describe_os_error(e, out) from None
        raise
    return [out / name for name in images]
