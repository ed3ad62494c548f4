"""How often the expert a token needs is already in memory, for stock llama.cpp and for
``run --prefetch``, at any budget: from a routing trace when there is one, else from stated
priors shown as a range.

``run --prefetch`` keeps a per-layer LRU of experts (the live cache): with a trace its hit
rate at ``s`` slots is exact from LRU stack distances (Mattson), per layer, over the trace's
decode tokens. Stock llama.cpp keeps what the kernel's page cache keeps: the trace's decode
tokens are replayed through a model of its two lists, refault activation and fault
read-around (``pagecache``), with the read-around window measured per device.

Without a trace, two priors bound the hit rate at a cache holding a fraction ``f`` of each
layer's experts:

- **uniform** routing (the floor: every expert as likely as any other, independent tokens):
  ``f`` — no policy does better on i.i.d. routing;
- **recency**, ``f ** 0.172``: fitted to the one published LRU curve of real routing we have,
  llama.cpp PR #27861 (open; a 512-expert model, 54k routing records): LRU-64 (f = 0.125)
  hit ~67 %, LRU-128 (f = 0.25) ~81 % (the exponent is the mean of log 0.67 / log 0.125 and
  log 0.81 / log 0.25). Other reports sit inside the range: turboquant-mlx's byte-budget
  LRU 60 % at f = 0.125 and 91 % at 0.5; one DeepSeek model only 8–18 % (near the floor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checkpoint.model import MoeModel
from ..errors import BadInput
from ..trace.core import RoutingTrace
from ..trace.formats import load_trace
from ..trace.stackdist import stack_distances
from .pagecache import replay, replay_unit
from .shapes import ModelShape

RECENCY_EXPONENT = 0.172
RECENCY_SOURCE = (
    "llama.cpp PR #27861: LRU-64 of 512 experts ~67 % hit, LRU-128 ~81 % on real routing"
)
MAX_REPLAY_TOKENS = 32  # decode tokens the page-cache replay plays (twice: warm, then counted)
SHARD_STRIDE = 1 << 40  # replay units of shard i start at i * SHARD_STRIDE


@dataclass(frozen=True)
class HitRange:
    """A hit rate: ``low == high`` when it came from a trace."""

    low: float
    high: float

    @property
    def mid(self) -> float:
        return (self.low + self.high) / 2

    def to_json(self) -> dict[str, float]:
        return {"low": self.low, "high": self.high}


def recency_prior(fraction: float) -> float:
    return min(1.0, max(0.0, fraction)) ** RECENCY_EXPONENT if fraction > 0 else 0.0


class HitModel:
    """Hit rates at any budget for one model: from ``trace`` or from the priors."""

    def __init__(self, shape: ModelShape, trace: RoutingTrace | None, model: MoeModel) -> None:
        self.shape = shape
        self.trace = trace
        self.source = "trace" if trace is not None else "priors"
        self._layer_hist: np.ndarray | None = None
        self._decode_lookups = 0
        self._replays: dict[tuple[int, int], float] = {}
        self._touched: dict[int, float] = {}
        self._model = model
        if trace is not None:
            self._prepare_layers(trace)

    # -- the live cache (per layer LRU of experts) -------------------------------------------
    def _decode_rows(self, trace: RoutingTrace) -> np.ndarray:
        mask = trace.phase_mask("decode")
        return mask if mask.any() else np.ones(trace.tokens, dtype=bool)

    def _prepare_layers(self, trace: RoutingTrace) -> None:
        ids = np.asarray(trace.ids)
        rows = self._decode_rows(trace)
        hist = np.zeros(self.shape.n_expert + 1, dtype=np.int64)
        for layer in range(ids.shape[1]):
            d = stack_distances(ids[:, layer], trace.n_expert)[rows].ravel()
            d = np.where(d < 0, self.shape.n_expert, np.minimum(d, self.shape.n_expert))
            hist += np.bincount(d, minlength=self.shape.n_expert + 1)[: self.shape.n_expert + 1]
        self._layer_hist = np.cumsum(hist)
        self._decode_lookups = int(hist.sum())

    def live_cache(self, slots: int) -> HitRange:
        """Hit rate of the per-layer LRU at ``slots`` experts per layer."""
        slots = max(0, min(slots, self.shape.n_expert))
        if self._layer_hist is not None:
            h = float(self._layer_hist[slots - 1]) / self._decode_lookups if slots else 0.0
            return HitRange(h, h)
        f = slots / self.shape.n_expert
        return HitRange(f, recency_prior(f))

    # -- a prompt's experts ------------------------------------------------------------------
    def touched(self, tokens: int) -> float:
        """Distinct experts of a layer that ``tokens`` prompt tokens choose: from the trace's
        prompts where they are that long (real text repeats its experts more than
        independent tokens do), else uniform routing's ``n (1 - (1 - k/n)^tokens)``."""
        s = self.shape
        uniform = s.n_expert * (1 - (1 - s.top_k / max(1, s.n_expert)) ** tokens)
        if self.trace is None or tokens <= 0:
            return uniform
        got = self._touched.get(tokens)
        if got is not None:
            return got
        ids = np.asarray(self.trace.ids)
        counts = []
        for seg in self.trace.prompt_segments:
            if seg.prefill < tokens:
                continue
            rows = ids[seg.start : seg.start + tokens]
            counts += [len(np.unique(rows[:, layer])) for layer in range(ids.shape[1])]
        value = float(np.mean(counts)) if counts else uniform
        self._touched[tokens] = value
        return value

    # -- the page cache (stock llama.cpp: the kernel's two lists, replayed) -----------------
    def _replay_ids(self) -> np.ndarray:
        """Routing to replay (tokens x layers x k): the trace's last decode tokens, or
        uniform routing (seeded) for the priors."""
        s = self.shape
        if self.trace is not None:
            ids = np.asarray(self.trace.ids)[self._decode_rows(self.trace)]
            return ids[-MAX_REPLAY_TOKENS:]
        rng = np.random.default_rng(0)
        layers = len(self._model.run_block_indices)
        ids = np.stack(
            [
                np.stack([rng.choice(s.n_expert, s.top_k, replace=False) for _ in range(layers)])
                for _ in range(MAX_REPLAY_TOKENS)
            ]
        )
        return ids

    def _replay(self, cache_bytes: int, window: int) -> float:
        """Faults per decode token of stock llama.cpp, replayed (see ``pagecache``)."""
        key = (cache_bytes, window)
        got = self._replays.get(key)
        if got is not None:
            return got
        ids = self._replay_ids()
        unit = replay_unit(self.shape.active_expert_bytes, window)
        model = self._model
        blocks = (
            self.trace.resolved_block_map(model)
            if self.trace is not None
            else model.run_block_indices
        )
        by_index = {b.index: b for b in model.blocks}
        order = {"gate": 0, "gate_up": 0, "up": 1, "down": 2}
        ends: dict[int, int] = {}
        for b in model.blocks:
            for t in b.tensors:
                ends[t.shard] = max(ends.get(t.shard, 0), t.entry.offset + t.entry.n_bytes)
        limits = {
            shard: (shard * SHARD_STRIDE, shard * SHARD_STRIDE + -(-end // unit))
            for shard, end in ends.items()
        }
        tensors = [
            sorted(by_index[b].weight_tensors, key=lambda t: order.get(t.kind, 3)) for b in blocks
        ]
        tokens: list[list[tuple[int, int]]] = []
        for row in ids:
            ranges: list[tuple[int, int]] = []
            for layer, layer_tensors in enumerate(tensors):
                experts = sorted(int(e) for e in row[layer])
                for t in layer_tensors:
                    base = t.shard * SHARD_STRIDE
                    for e in experts:
                        off = t.slice_offset(e)
                        ranges.append(
                            (base + off // unit, base + (off + t.slice_bytes - 1) // unit)
                        )
            tokens.append(ranges)
        run = replay(
            tokens + tokens,
            cache_bytes,
            window,
            unit,
            limits,
            len(tokens),
            shard_stride=SHARD_STRIDE,
        )
        self._replays[key] = run.faults
        return run.faults

    def page_cache(self, cache_bytes: int, window: int) -> tuple[float, float]:
        """Faults per token of stock llama.cpp (low, high) with ``cache_bytes`` of page cache
        for experts and read-around windows of ``window`` bytes: replayed from the trace, or
        without one from uniform routing (the most faults) down to the recency prior."""
        window = max(4096, int(window))
        s = self.shape
        if cache_bytes >= s.expert_bytes:
            return 0.0, 0.0
        many = self._replay(cache_bytes, window)
        if self.trace is not None:
            return many, many
        per_matrix = []
        for sl in s.slice_bytes:
            span = s.n_expert * sl
            n_w = max(1, math.ceil(span / window))
            if window >= sl:
                touched = n_w * (1 - (1 - 1 / n_w) ** s.top_k)
            else:
                touched = s.top_k * math.ceil(sl / window)
            per_matrix.append(touched)
        touched_all = s.moe_layers * sum(per_matrix)
        f = min(1.0, cache_bytes / s.expert_bytes)
        return min(many, touched_all * (1 - recency_prior(f))), many


def bound_trace(path: Path, model: MoeModel, shape: ModelShape) -> RoutingTrace:
    """``path`` read and held to ``model`` by shape alone (the model may be a remote index
    whose bytes we never saw, or another copy of it): layers, experts, top-k."""
    trace = load_trace(path, n_expert=shape.n_expert if shape.n_expert > 0 else None, check=False)
    trace = trace.replace(model_fingerprint=None)
    trace.check_against(model)
    if not trace.tokens:
        raise BadInput("the trace has no tokens", path)
    return trace
