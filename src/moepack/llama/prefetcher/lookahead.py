"""Which experts a later layer will choose, guessed while this layer computes.

While layer L's experts compute, the disk can already read what layer L+1 (and L+2) will
probably route to. Predictors, all answering "scores per expert of layer L+d for this pass's
tokens":

- ``router`` (pre-gating): layer L+d's own router applied to the activations layer L's router
  read (the input of ``ffn_moe_logits-L``, the one node every family names), rescaled from
  layer L's FFN norm to layer L+d's where both exist. The residual stream changes little from
  one layer to the next, so the next router mostly agrees with itself. Its weights are
  dequantised once (``n_expert × n_embd`` floats per MoE block).
- the ``stream`` predictors (``cross-layer``, ``markov``, ``sticky``, ``frequency``, and
  ``+`` combinations with each other and with ``router``), fitted on a trace when one is
  given and refitted online on the run's own recent tokens (a ring of ``HISTORY`` tokens)
  every ``REFIT`` tokens, scored on the current token.

How many experts to fetch adapts per layer to the predictor's own measured precision
(``Budget``): at ``HIGH`` precision or better the whole budget, below ``LOW`` nothing but a
probe now and then, in between a share. Routing with no structure across layers therefore
costs a probe per layer every ``PROBE_EVERY`` passes. Live recall and precision per layer,
and speculative bytes read and wasted, are counted (``LookaheadStats``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from ...checkpoint.model import MoeModel
from ...errors import BadInput
from ...stream.predictor import Context, Predictor, combined_scores, resolve

ROUTER = "router"
HISTORY = 256
REFIT = 32
LOW, HIGH = 0.2, 0.5
ALL_ROWS = 64
"""A pass of more tokens speculates every expert of the next layer (the C hook's rule too)."""
PROBE_EVERY = 16
EWMA = 0.2
NORM_NAMES = ("ffn_norm", "post_attention_norm")


def _matrix(model: MoeModel, name: str) -> np.ndarray | None:
    """A 2-D tensor of the model as float32 ``[rows, cols]`` (numpy order), or None."""
    entry = model.tensors.get(name)
    if entry is None:
        return None
    path = model.shard_paths[model.tensor_shard[name]]
    with open(path, "rb", buffering=0) as fh:
        raw = os.pread(fh.fileno(), entry.n_bytes, entry.offset)
    data = np.frombuffer(raw, dtype=np.uint8)
    ne = [int(n) for n in entry.ne]
    rows = int(np.prod(ne[1:])) if len(ne) > 1 else 1
    if entry.ggml_type == GGMLQuantizationType.F32:
        out = data.view("<f4").reshape(rows, ne[0])
    elif entry.ggml_type == GGMLQuantizationType.F16:
        out = data.view("<f2").astype(np.float32).reshape(rows, ne[0])
    else:
        out = dequantize(data.reshape(rows, -1), entry.ggml_type).reshape(rows, ne[0])
    return np.ascontiguousarray(out, dtype=np.float32)


class RouterPredictor:
    """Pre-gating: later layers' routers on this layer's router input."""

    def __init__(self, model: MoeModel) -> None:
        self.weights: dict[int, np.ndarray] = {}
        self.bias: dict[int, np.ndarray] = {}
        self.norm: dict[int, np.ndarray] = {}
        for block in model.blocks:
            w = _matrix(model, f"blk.{block.index}.ffn_gate_inp.weight")
            if w is None or w.shape[0] != block.n_expert:
                continue
            self.weights[block.index] = w
            for bias in ("exp_probs_b.bias", "ffn_gate_inp.bias"):
                b = _matrix(model, f"blk.{block.index}.{bias}")
                if b is not None and b.size == block.n_expert:
                    self.bias[block.index] = b.reshape(-1)
                    break
            for norm in NORM_NAMES:
                g = _matrix(model, f"blk.{block.index}.{norm}.weight")
                if g is not None and g.size == w.shape[1] and np.all(g != 0):
                    self.norm[block.index] = g.reshape(-1)
                    break

    def scores(self, target: int, source: int, x: np.ndarray) -> np.ndarray | None:
        """``[rows, n_expert]`` router scores of block ``target`` for the activations ``x``
        (``[rows, n_embd]``) that block ``source``'s router read; None when unknown."""
        w = self.weights.get(target)
        if w is None or x.ndim != 2 or x.shape[1] != w.shape[1]:
            return None
        if source in self.norm and target in self.norm:
            x = x * (self.norm[target] / self.norm[source])
        logits = x.astype(np.float32, copy=False) @ w.T
        if target in self.bias:
            logits = logits + self.bias[target]
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        return np.asarray(p / p.sum(axis=1, keepdims=True), dtype=np.float32)


class StreamPredictors:
    """``stream`` predictors scored online on the current token, refitted on recent ones."""

    def __init__(
        self, parts: list[Predictor], blocks: Sequence[int], n_expert: int, k: int
    ) -> None:
        self.parts = parts
        self.blocks = list(blocks)
        self.layer_of = {b: i for i, b in enumerate(self.blocks)}
        self.n_expert = n_expert
        self.k = k
        self.history = np.zeros((HISTORY, len(self.blocks), k), dtype=np.int64)
        self.filled = 0  # rows of history that hold a complete token
        self.current = np.zeros((len(self.blocks), k), dtype=np.int64)
        self.learned: list[list[object]] = [[None] * len(self.blocks) for _ in parts]
        self.frequency = np.full((len(self.blocks), n_expert), 1.0 / n_expert)
        self.since_fit = 0
        self.fitted_on_trace = False

    def fit(self, train: np.ndarray) -> None:
        """Learn from a trace's tokens ``[tokens, layers, k]`` (its layers = these blocks)."""
        if train.shape[1:] != (len(self.blocks), self.k) or train.shape[0] < 2:
            raise BadInput(
                f"a lookahead trace has {train.shape[1:]} layers x top-k, the model "
                f"{(len(self.blocks), self.k)}"
            )
        self._fit(np.asarray(train, dtype=np.int64))
        self.fitted_on_trace = True

    def _fit(self, train: np.ndarray) -> None:
        for i, part in enumerate(self.parts):
            for layer in range(len(self.blocks)):
                self.learned[i][layer] = part.fit(train, self.n_expert, layer)
        for layer in range(len(self.blocks)):
            counts = np.bincount(train[:, layer].ravel(), minlength=self.n_expert)
            self.frequency[layer] = (counts + 1) / (counts.sum() + self.n_expert)

    def observe(self, block: int, ids: np.ndarray) -> None:
        """This pass's last token chose ``ids`` (``[k]``) at ``block``."""
        layer = self.layer_of.get(block)
        if layer is None or ids.size != self.k:
            return
        self.current[layer] = ids
        if layer == len(self.blocks) - 1:  # the token is complete
            self.history = np.roll(self.history, -1, axis=0)
            self.history[-1] = self.current
            self.filled = min(HISTORY, self.filled + 1)
            self.since_fit += 1
            if not self.fitted_on_trace and self.since_fit >= REFIT and self.filled >= 2:
                self._fit(self.history[-self.filled :])
                self.since_fit = 0

    def scores(self, target: int) -> np.ndarray | None:
        """``[1, n_expert]`` scores of the current token at block ``target``."""
        layer = self.layer_of.get(target)
        if layer is None or (self.filled < 2 and not self.fitted_on_trace):
            return None
        ids = np.stack([self.history[-1], self.current])
        ctx = Context(
            ids=ids,
            layer=layer,
            starts=np.array([False, False]),
            frequency=self.frequency[layer],
        )
        learned = [self.learned[i][layer] for i in range(len(self.parts))]
        return combined_scores(self.parts, ctx, learned)[-1:]


@dataclass
class LayerLookahead:
    """One MoE layer's speculation, summed over passes."""

    predicted: int = 0  # experts speculated for this layer
    hits: int = 0  # of those, chosen
    chosen: int = 0  # experts this layer chose in passes that had a speculation
    bytes_read: int = 0  # speculative bytes the fetcher found missing and asked for
    bytes_wasted: int = 0  # of those, experts this layer then did not choose
    precision_ewma: float = HIGH

    def to_json(self) -> dict[str, float]:
        return {
            "predicted": self.predicted,
            "hits": self.hits,
            "recall": self.hits / self.chosen if self.chosen else 0.0,
            "precision": self.hits / self.predicted if self.predicted else 0.0,
            "bytes_read": self.bytes_read,
            "bytes_wasted": self.bytes_wasted,
        }


@dataclass
class LookaheadStats:
    layers: dict[int, LayerLookahead] = field(default_factory=dict)

    @classmethod
    def from_counts(cls, per: dict[int, dict[str, int]]) -> LookaheadStats:
        """The record as the C hook counted it (``native.CStream.stats``)."""
        out = cls()
        for block, c in per.items():
            if c["predicted"] or c["chosen"]:
                out.layers[block] = LayerLookahead(
                    c["predicted"], c["hits"], c["chosen"], c["bytes_read"], c["bytes_wasted"]
                )
        return out

    def layer(self, block: int) -> LayerLookahead:
        return self.layers.setdefault(block, LayerLookahead())

    def to_json(self) -> dict[str, Any]:
        per = {str(b): s.to_json() for b, s in sorted(self.layers.items())}
        predicted = sum(s.predicted for s in self.layers.values())
        hits = sum(s.hits for s in self.layers.values())
        chosen = sum(s.chosen for s in self.layers.values())
        return {
            "recall": hits / chosen if chosen else 0.0,
            "precision": hits / predicted if predicted else 0.0,
            "bytes_read": sum(s.bytes_read for s in self.layers.values()),
            "bytes_wasted": sum(s.bytes_wasted for s in self.layers.values()),
            "per_layer": per,
        }


def fetch_count(budget: int, precision: float, passes: int) -> int:
    """How many predicted experts to fetch for a layer whose speculation has been right
    ``precision`` of the time (an EWMA): all of ``budget`` at ``HIGH`` or better, none below
    ``LOW`` but one every ``PROBE_EVERY`` passes (to notice when it becomes right), a share
    in between."""
    if precision >= HIGH:
        return budget
    if precision < LOW:
        return 1 if passes % PROBE_EVERY == 0 else 0
    return max(1, round(budget * (precision - LOW) / (HIGH - LOW)))


class Lookahead:
    """Predictions for later layers, their adaptive budget and their live record."""

    def __init__(
        self,
        model: MoeModel,
        spec: str,
        budget: int,
        depth: int = 1,
        trace_ids: np.ndarray | None = None,
    ) -> None:
        names = [p.strip() for p in spec.split("+")]
        self.blocks = [b.index for b in model.blocks]
        self.next_block = {a: b for a, b in zip(self.blocks, self.blocks[1:], strict=False)}
        self.n_expert = {b.index: b.n_expert for b in model.blocks}
        self.budget = budget
        self.depth = depth
        self.router = RouterPredictor(model) if ROUTER in names else None
        others = [n for n in names if n != ROUTER]
        self.stream: StreamPredictors | None = None
        if others:
            parts = resolve("+".join(others))
            n_expert = max(self.n_expert.values())
            self.stream = StreamPredictors(parts, self.blocks, n_expert, model.top_k)
            if trace_ids is not None:
                self.stream.fit(trace_ids)
        self.stats = LookaheadStats()
        self.pending: dict[int, set[int]] = {}  # block -> experts speculated, not yet judged
        self.read: dict[int, dict[int, int]] = {}  # block -> expert -> speculative bytes read
        self.passes = 0

    def record_read(self, block: int, expert: int, nbytes: int) -> None:
        """The fetcher read ``nbytes`` of ``expert`` at ``block`` on speculation."""
        if nbytes:
            per = self.read.setdefault(block, {})
            per[expert] = per.get(expert, 0) + nbytes

    def targets(self, block: int) -> list[int]:
        """The later MoE blocks to speculate for from ``block`` (up to ``depth``)."""
        out, b = [], block
        for _ in range(self.depth):
            nxt = self.next_block.get(b)
            if nxt is None:
                break
            out.append(nxt)
            b = nxt
        return out

    def judge(self, block: int, chosen: set[int]) -> None:
        """The real choice at ``block`` arrived: score what was speculated for it."""
        if block == self.blocks[0]:
            self.passes += 1
        st = self.stats.layer(block)
        for expert, nbytes in self.read.pop(block, {}).items():
            st.bytes_read += nbytes
            if expert not in chosen:
                st.bytes_wasted += nbytes
        spec = self.pending.pop(block, None)
        if spec is None:
            return
        hit = len(spec & chosen)
        st.predicted += len(spec)
        st.hits += hit
        st.chosen += len(chosen)
        if spec:
            st.precision_ewma += EWMA * (hit / len(spec) - st.precision_ewma)

    def predict(
        self, source: int, x: np.ndarray | None, rows: int, chosen: set[int]
    ) -> dict[int, list[int]]:
        """Experts to fetch for each target block, best first, for a pass of ``rows``
        tokens whose router input at ``source`` was ``x`` (None: not read)."""
        out: dict[int, list[int]] = {}
        for target in self.targets(source):
            st = self.stats.layer(target)
            n_expert = self.n_expert[target]
            count = min(fetch_count(self.budget, st.precision_ewma, self.passes), n_expert)
            if count <= 0:
                continue
            if rows > ALL_ROWS:  # a long pass touches every expert of the next layer
                picked = list(range(n_expert))
            else:
                scores = self._scores(target, source, x)
                if scores is None:
                    continue
                # each token's best ``count``, the union over the pass's tokens
                best = np.argsort(-scores, axis=1, kind="stable")[:, :count]
                picked = [int(e) for e in dict.fromkeys(best.T.ravel().tolist())]
            self.pending[target] = set(picked)
            out[target] = picked
        return out

    def _scores(self, target: int, source: int, x: np.ndarray | None) -> np.ndarray | None:
        parts: list[np.ndarray] = []
        if self.router is not None and x is not None:
            s = self.router.scores(target, source, x)
            if s is not None:
                parts.append(s / np.maximum(s.max(axis=1, keepdims=True), 1e-12))
        if self.stream is not None:
            s = self.stream.scores(target)
            if s is not None:
                n = self.n_expert[target]
                s = s[:, :n]
                parts.append(s / np.maximum(s.max(axis=1, keepdims=True), 1e-12))
        if not parts:
            return None
        rows = max(p.shape[0] for p in parts)
        return sum((np.broadcast_to(p, (rows, p.shape[1])) for p in parts), np.zeros(1))

    def observe(self, block: int, ids: np.ndarray) -> None:
        """Feed the online predictors this pass's last token's choice at ``block``."""
        if self.stream is not None and ids.ndim == 2 and ids.shape[0] >= 1:
            self.stream.observe(block, np.asarray(ids[-1], dtype=np.int64))
