"""``sticky``: the previous token's experts in this layer route again (temporal reuse)."""

from __future__ import annotations

import numpy as np

from ..predictor import Context, Predictor, onehot, previous_rows

ORDER = 20


class Sticky(Predictor):
    name = "sticky"
    summary = "the previous token's experts in the same layer"
    aliases = ("previous-token",)

    def scores(self, ctx: Context, learned: object) -> np.ndarray:
        ids = np.asarray(ctx.ids[:, ctx.layer, :])
        out = onehot(previous_rows(ids), ctx.n_expert)
        out[ctx.starts] = 0.0
        return out


PLUGIN = Sticky()
