"""``markov``: first-order transitions within a layer, from the previous token's experts to
this token's, counted on the training tokens."""

from __future__ import annotations

import numpy as np

from ..predictor import Context, Predictor, Transitions, previous_rows, transition_counts

ORDER = 30


class Markov(Predictor):
    name = "markov"
    summary = "previous token's experts -> this token's, transition counts"

    def fit(self, train: np.ndarray, n_expert: int, layer: int) -> object:
        ids = np.asarray(train[:, layer, :])
        return transition_counts(ids[:-1], ids[1:], n_expert)

    def scores(self, ctx: Context, learned: object) -> np.ndarray:
        assert isinstance(learned, Transitions)
        out = learned.scores(previous_rows(np.asarray(ctx.ids[:, ctx.layer, :])))
        out[ctx.starts] = 0.0
        return out


PLUGIN = Markov()
