"""``frequency``: a static hot list, the layer's most used experts in the training tokens."""

from __future__ import annotations

import numpy as np

from ..predictor import Context, Predictor

ORDER = 10


class Frequency(Predictor):
    name = "frequency"
    summary = "the training tokens' most used experts (a static hot list)"
    aliases = ("hot",)

    def scores(self, ctx: Context, learned: object) -> np.ndarray:
        return np.broadcast_to(
            ctx.frequency.astype(np.float32)[None, :], (ctx.ids.shape[0], ctx.n_expert)
        ).copy()


PLUGIN = Frequency()
