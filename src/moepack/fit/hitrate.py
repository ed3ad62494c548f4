"""How often the expert a token needs is already in memory, for stock llama.cpp and for
``run --prefetch``, at any budget: from a routing trace when there is one, else from stated
priors shown as a range.

``run --prefetch`` keeps a per-layer LRU of experts (the live cache): with a trace its hit
rate at ``s`` slots is exact from LRU stack distances (Mattson), per layer, over the trace's
decode tokens. Stock llama.cpp keeps what the kernel's page cache keeps: modelled as one LRU
of fault read-around windows (the bytes one fault brings in, measured per device) over the
whole file, replayed from the same trace in window units.

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
from .shapes import ModelShape

RECENCY_EXPONENT = 0.172
RECENCY_SOURCE = (
    "llama.cpp PR #27861: LRU-64 of 512 experts ~67 % hit, LRU-128 ~81 % on real routing"
)
MAX_WINDOW_ACCESSES = 100_000  # the stock replay's last tokens are enough for its hit rate


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


def _window_distances(ids: np.ndarray) -> np.ndarray:
    """LRU stack distance of each access of a 1-D stream of ids (-1: first access), with a
    Fenwick tree over positions: O(n log n)."""
    n = ids.size
    tree = np.zeros(n + 1, dtype=np.int64)
    last: dict[int, int] = {}
    out = np.full(n, -1, dtype=np.int64)
    t = tree  # local alias for speed

    def add(i: int, v: int) -> None:
        i += 1
        while i <= n:
            t[i] += v
            i += i & -i

    def prefix(i: int) -> int:  # sum of [0, i)
        s = 0
        while i > 0:
            s += int(t[i])
            i -= i & -i
        return s

    live = 0
    for pos, w in enumerate(ids.tolist()):
        prev = last.get(w)
        if prev is not None:
            out[pos] = live - prefix(prev + 1)  # distinct ids accessed after prev
            add(prev, -1)
            live -= 1
        add(pos, 1)
        live += 1
        last[w] = pos
    return out


class HitModel:
    """Hit rates at any budget for one model: from ``trace`` or from the priors."""

    def __init__(self, shape: ModelShape, trace: RoutingTrace | None, model: MoeModel) -> None:
        self.shape = shape
        self.trace = trace
        self.source = "trace" if trace is not None else "priors"
        self._layer_hist: np.ndarray | None = None
        self._decode_lookups = 0
        self._windows: dict[int, tuple[np.ndarray, int, int]] = {}
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

    # -- the page cache (one LRU of fault windows over the file) ----------------------------
    def _window_stream(self, window: int) -> tuple[np.ndarray, int, int]:
        """Stack distances (in windows) of the trace's last tokens, the decode accesses'
        positions masked, and the decode tokens replayed."""
        got = self._windows.get(window)
        if got is not None:
            return got
        assert self.trace is not None
        trace = self.trace
        ids = np.asarray(trace.ids)
        blocks = trace.resolved_block_map(self._model)
        by_index = {b.index: b for b in self._model.blocks}
        per_token = ids.shape[1] * ids.shape[2] * self.shape.matrices
        keep = max(1, min(ids.shape[0], MAX_WINDOW_ACCESSES // max(1, per_token)))
        first = ids.shape[0] - keep
        rows = self._decode_rows(trace)[first:]
        seq: list[np.ndarray] = []
        decode_flags: list[np.ndarray] = []
        for t in range(first, ids.shape[0]):
            for layer, b in enumerate(blocks):
                for tensor in by_index[b].weight_tensors:
                    offs = tensor.entry.offset + ids[t, layer].astype(np.int64) * tensor.slice_bytes
                    lo = (tensor.shard << 48) + offs // window
                    hi = (tensor.shard << 48) + (offs + tensor.slice_bytes - 1) // window
                    for a, z in zip(lo.tolist(), hi.tolist(), strict=True):
                        w = np.arange(a, z + 1, dtype=np.int64)
                        seq.append(w)
                        decode_flags.append(np.full(w.size, rows[t - first]))
        stream = np.concatenate(seq)
        dist = _window_distances(stream)
        flags = np.concatenate(decode_flags)
        got = (dist[flags], int(rows.sum()), 0)
        self._windows[window] = got
        return got

    def page_cache(self, cache_bytes: int, window: int) -> tuple[float, float]:
        """Faults per token of stock llama.cpp (low, high) with ``cache_bytes`` of page cache
        for experts and read-around windows of ``window`` bytes."""
        window = max(4096, int(window))
        s = self.shape
        if cache_bytes >= s.expert_bytes:
            return 0.0, 0.0
        if self.trace is not None:
            dist, tokens, _ = self._window_stream(window)
            capacity = cache_bytes // window
            misses = int(np.count_nonzero((dist < 0) | (dist >= capacity)))
            f = misses / max(1, tokens)
            return f, f
        # priors: windows a token touches per matrix, and the share of them resident
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
        return touched_all * (1 - recency_prior(f)), touched_all * (1 - f)


def bound_trace(path: Path, model: MoeModel, shape: ModelShape) -> RoutingTrace:
    """``path`` read and held to ``model`` by shape alone (the model may be a remote index
    whose bytes we never saw, or another copy of it): layers, experts, top-k."""
    trace = load_trace(path, n_expert=shape.n_expert if shape.n_expert > 0 else None, check=False)
    trace = trace.replace(model_fingerprint=None)
    trace.check_against(model)
    if not trace.tokens:
        raise BadInput("the trace has no tokens", path)
    return trace
