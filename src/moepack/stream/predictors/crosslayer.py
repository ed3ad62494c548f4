"""``cross-layer``: the same token's choice in the previous MoE layer predicts this layer's
(colibri's one-layer router lookahead), transitions counted on the training tokens. The
first layer has no previous one and falls back to the hot list."""

from __future__ import annotations

import numpy as np

from ..predictor import Context, Predictor, Transitions, transition_counts

ORDER = 40


class CrossLayer(Predictor):
    name = "cross-layer"
    summary = "the same token's previous-layer experts -> this layer's, transition counts"
    aliases = ("previous-layer",)

    def fit(self, train: np.ndarray, n_expert: int, layer: int) -> object:
        if layer == 0:
            return None
        return transition_counts(
            np.asarray(train[:, layer - 1, :]), np.asarray(train[:, layer, :]), n_expert
        )

    def scores(self, ctx: Context, learned: object) -> np.ndarray:
        if not isinstance(learned, Transitions):
            return np.zeros((ctx.ids.shape[0], ctx.n_expert), dtype=np.float32)
        return learned.scores(np.asarray(ctx.ids[:, ctx.layer - 1, :]))


PLUGIN = CrossLayer()
