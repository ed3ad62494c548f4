"""A co-activation map as a PNG: which experts fire together, before and after a plan.

Two heatmaps of one block's co-activation counts: in the checkpoint's expert order and in the
planned slot order. A good plan turns scattered dots into blocks along the diagonal — the
contiguous runs that become larger, fewer reads.
"""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def coactivation_png(coact: np.ndarray, perm: np.ndarray, title: str) -> bytes:
    """PNG bytes: ``coact[e, f]`` in expert order (left) and in slot order ``perm`` (right)."""
    after = coact[np.ix_(perm, perm)]
    vmax = float(np.percentile(coact[coact > 0], 99)) if np.any(coact > 0) else 1.0
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.8), dpi=110, layout="constrained")
    for ax, mat, label in ((axes[0], coact, "checkpoint order"), (axes[1], after, "planned order")):
        im = ax.imshow(mat, cmap="magma", vmin=0, vmax=vmax, interpolation="nearest")
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("expert slot")
        ax.set_ylabel("expert slot")
    fig.colorbar(im, ax=axes, label="tokens choosing both", shrink=0.85)
    fig.suptitle(title, fontsize=11)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()
