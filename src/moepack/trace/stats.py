"""Statistics of a routing trace, vectorised and computed in bounded chunks of tokens.

Public API used by other parts of moepack (keep stable):

- ``coactivation(trace, layer, phase="all") -> np.ndarray[n_expert, n_expert]``: how many tokens
  chose both experts at trace layer ``layer`` (symmetric, int64, diagonal zero);
- ``expert_counts(trace, phase="all") -> np.ndarray[layers, n_expert]``: routings per expert;
- ``overlap(trace, lag=1, phase="all") -> np.ndarray[layers]``: mean share of a token's k
  experts that the token ``lag`` positions earlier also chose (both inside ``phase``);
- ``distinct_experts``, ``window_distinct``, ``routing_entropy``, ``hot_recall``;
- ``summarize(trace) -> TraceStats``: all of it per layer and per phase, for ``trace info``.

``phase`` is ``"all"``, ``"prefill"`` or ``"decode"``, taken per prompt (``RoutingTrace.
phase_runs``): in a trace of several prompts, pairs of tokens for overlap and windows lie
within one prompt's run of the phase, never across two prompts. An empty
phase (a trace without prefill tokens, or without decode tokens) is not an error here: counts
are zero and rates NaN, which is what they are. A caller that needs the phase refuses it (the
planner does); ``summarize`` leaves it out and says so in ``TraceStats.notes``, as it does for
every overlap it could not compute (NaN: fewer tokens than the lag needs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import BadInput
from .core import RoutingTrace, token_chunks
from .pairs import pair_counts

_CELLS = 1 << 20


def _runs(trace: RoutingTrace, phase: str) -> list[slice]:
    return trace.phase_runs(phase)


def _check_layer(trace: RoutingTrace, layer: int) -> int:
    layer = int(layer)
    if not 0 <= layer < trace.layers:
        raise BadInput(f"trace layer {layer} does not exist (0..{trace.layers - 1})", trace.path)
    return layer


def expert_counts(trace: RoutingTrace, phase: str = "all") -> np.ndarray:
    """``[layers, n_expert]``: how many tokens of ``phase`` routed to each expert."""
    L, n, k = trace.layers, trace.n_expert, trace.k
    out = np.zeros(L * n, dtype=np.int64)
    offset = (np.arange(L, dtype=np.int64) * n)[None, :, None]
    for rng in _runs(trace, phase):
        for sl in token_chunks(rng.stop - rng.start, L * k, _CELLS):
            a, b = rng.start + sl.start, rng.start + sl.stop
            block = np.asarray(trace.ids[a:b], dtype=np.int64)
            out += np.bincount((block + offset).ravel(), minlength=L * n)
    return out.reshape(L, n)


def coactivation(trace: RoutingTrace, layer: int, phase: str = "all") -> np.ndarray:
    """``[n_expert, n_expert]``: tokens (of ``phase``) that chose both experts at ``layer``.

    Symmetric, int64, zero diagonal (``expert_counts`` has the per-expert totals).
    """
    layer = _check_layer(trace, layer)
    n = trace.n_expert
    mat = np.zeros((n, n), dtype=np.int64)
    for rng in _runs(trace, phase):
        rows = trace.ids[rng, layer, :]
        mat += pair_counts(rows, rows, n)
    np.fill_diagonal(mat, 0)
    return mat


def shared_counts(cur: np.ndarray, prev: np.ndarray) -> np.ndarray:
    """``[..., k] x [..., k] -> [...]``: experts two rows have in common (rows hold no
    duplicates, so this is the size of the intersection)."""
    k = cur.shape[-1]
    if k > 16:
        return (cur[..., :, None] == prev[..., None, :]).any(axis=-1).sum(axis=-1)
    shape = cur.shape[:-1]
    c = np.ascontiguousarray(cur.reshape(-1, k).T)
    p = np.ascontiguousarray(prev.reshape(-1, k).T)
    acc = np.zeros(c.shape[1], dtype=np.uint8)
    for i in range(k):
        for j in range(k):
            acc += c[i] == p[j]
    return acc.reshape(shape)


def shared_with_lag(trace: RoutingTrace, lag: int) -> np.ndarray:
    """``[tokens - lag, layers]`` uint8: experts token ``t`` shares with token ``t - lag``
    (row ``t - lag``). One pass over the ids; phases are slices of the result."""
    lag = int(lag)
    if lag < 1:
        raise BadInput(f"lag must be >= 1, got {lag}")
    L, k = trace.layers, trace.k
    n = max(0, trace.tokens - lag)
    out = np.zeros((n, L), dtype=np.uint8 if k < 256 else np.int64)
    for sl in token_chunks(n, L * k, _CELLS):
        a, b = lag + sl.start, lag + sl.stop
        out[sl] = shared_counts(
            np.asarray(trace.ids[a:b]), np.asarray(trace.ids[a - lag : b - lag])
        )
    return out


def _overlap_from(shared: np.ndarray, trace: RoutingTrace, lag: int, phase: str) -> np.ndarray:
    total = np.zeros(trace.layers, dtype=np.int64)
    pairs = 0
    for rng in _runs(trace, phase):
        lo, hi = rng.start, rng.stop - lag  # pairs (t - lag, t), both in this prompt's run
        if hi > lo:
            total += shared[lo:hi].sum(axis=0, dtype=np.int64)
            pairs += hi - lo
    if pairs == 0:
        return np.full(trace.layers, np.nan)
    return total / (pairs * trace.k)


def overlap(trace: RoutingTrace, lag: int = 1, phase: str = "all") -> np.ndarray:
    """``[layers]``: mean ``|S_t ∩ S_{t-lag}| / k`` over token pairs inside one prompt's
    run of ``phase``.

    NaN for layers when ``phase`` has no pair ``lag`` apart.
    """
    return _overlap_from(shared_with_lag(trace, lag), trace, lag, phase)


def distinct_experts(trace: RoutingTrace, phase: str = "all") -> np.ndarray:
    """``[layers]``: experts chosen at least once in ``phase``."""
    return (expert_counts(trace, phase) > 0).sum(axis=1)


def window_distinct(trace: RoutingTrace, window: int, phase: str = "all") -> np.ndarray:
    """``[layers]``: mean distinct experts per non-overlapping window of ``window`` tokens
    within one prompt's run of ``phase`` (NaN when no run holds a whole window)."""
    window = int(window)
    if window < 1:
        raise BadInput(f"window must be >= 1, got {window}")
    L, n, k = trace.layers, trace.n_expert, trace.k
    total = np.zeros(L, dtype=np.int64)
    windows = 0
    per = max(1, _CELLS // (window * L * k))
    layer_off = (np.arange(L, dtype=np.int64) * n)[None, None, :, None]
    for rng in _runs(trace, phase):
        n_win = (rng.stop - rng.start) // window
        windows += n_win
        for w0 in range(0, n_win, per):
            w1 = min(n_win, w0 + per)
            a = rng.start + w0 * window
            block = np.asarray(trace.ids[a : a + (w1 - w0) * window], dtype=np.int64)
            block = block.reshape(w1 - w0, window, L, k)
            win_off = (np.arange(w1 - w0, dtype=np.int64) * (L * n))[:, None, None, None]
            hits = np.bincount((block + layer_off + win_off).ravel(), minlength=(w1 - w0) * L * n)
            total += (hits.reshape(w1 - w0, L, n) > 0).sum(axis=(0, 2))
    if windows == 0:
        return np.full(L, np.nan)
    return total / windows


def _entropy(counts: np.ndarray, n_expert: int, normalized: bool) -> np.ndarray:
    counts = counts.astype(np.float64)
    tot = counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(tot > 0, counts / np.maximum(tot, 1), 0.0)
        h = -np.where(p > 0, p * np.log2(np.where(p > 0, p, 1.0)), 0.0).sum(axis=1)
    h = np.where(tot[:, 0] > 0, h, np.nan)
    if normalized:
        return h / np.log2(n_expert) if n_expert > 1 else np.zeros_like(h)
    return h


def _hot(counts: np.ndarray, k: int) -> np.ndarray:
    tot = counts.sum(axis=1)
    top = -np.sort(-counts, axis=1)[:, :k].sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(tot > 0, top / np.maximum(tot, 1), np.nan)


def routing_entropy(
    trace: RoutingTrace, phase: str = "all", normalized: bool = False
) -> np.ndarray:
    """``[layers]``: entropy (bits) of each layer's expert frequency distribution;
    ``normalized`` divides by ``log2(n_expert)`` (1.0 = perfectly uniform routing)."""
    return _entropy(expert_counts(trace, phase), trace.n_expert, normalized)


def hot_recall(trace: RoutingTrace, phase: str = "all") -> np.ndarray:
    """``[layers]``: share of routings that land in the layer's k most-used experts (a
    static hot list; uniform routing gives k / n_expert)."""
    return _hot(expert_counts(trace, phase), trace.k)


@dataclass
class LayerStats:
    layer: int
    block: int | None
    distinct: int
    entropy: float  # normalised, 1.0 = uniform
    hot_recall: float
    overlap: float  # lag 1
    overlap_lag: float
    window_distinct: float


@dataclass
class PhaseStats:
    tokens: int
    distinct: float  # mean over layers
    entropy: float
    hot_recall: float
    overlap: float
    overlap_lag: float


@dataclass
class TraceStats:
    """Everything ``moepack trace info`` shows."""

    summary: dict[str, Any]
    lag: int
    window: int
    random_overlap: float  # what independent uniform routing would give: k / n_expert
    layers: list[LayerStats] = field(default_factory=list)
    phases: dict[str, PhaseStats] = field(default_factory=dict)
    binding: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)  # why a phase or a statistic is missing

    def to_json(self) -> dict[str, Any]:
        return {
            **self.summary,
            "lag": self.lag,
            "window": self.window,
            "random_overlap": self.random_overlap,
            "per_layer": [vars(s) for s in self.layers],
            "phases": {k: vars(v) for k, v in self.phases.items()},
            "binding": self.binding,
            "notes": list(self.notes),
        }


def _mean(a: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64)
    return float(np.nanmean(a)) if np.isfinite(a).any() else float("nan")


def summarize(
    trace: RoutingTrace, lag: int = 8, window: int = 1024, blocks: list[int] | None = None
) -> TraceStats:
    """Per-layer and per-phase statistics. ``blocks``: the GGUF block of each layer, when
    known (default: the trace's own block map). Two passes of overlap, one of counts."""
    blocks = blocks if blocks is not None else trace.block_map
    counts = {"all": expert_counts(trace)}
    if trace.prefill_tokens:
        counts["prefill"] = expert_counts(trace, "prefill")
        counts["decode"] = counts["all"] - counts["prefill"]
    else:
        counts["decode"] = counts["all"]
    sh1, shl = shared_with_lag(trace, 1), shared_with_lag(trace, lag)
    entropy = _entropy(counts["all"], trace.n_expert, True)
    hot = _hot(counts["all"], trace.k)
    ov1 = _overlap_from(sh1, trace, 1, "all")
    ovl = _overlap_from(shl, trace, lag, "all")
    win = window_distinct(trace, min(window, trace.tokens))
    rows = [
        LayerStats(
            layer=i,
            block=blocks[i] if blocks is not None else None,
            distinct=int((counts["all"][i] > 0).sum()),
            entropy=float(entropy[i]),
            hot_recall=float(hot[i]),
            overlap=float(ov1[i]),
            overlap_lag=float(ovl[i]),
            window_distinct=float(win[i]),
        )
        for i in range(trace.layers)
    ]
    phases: dict[str, PhaseStats] = {}
    for ph in ("prefill", "decode"):
        n_tokens = trace.phase_tokens(ph)
        if n_tokens == 0:
            continue
        c = counts[ph]
        phases[ph] = PhaseStats(
            tokens=n_tokens,
            distinct=_mean((c > 0).sum(axis=1)),
            entropy=_mean(_entropy(c, trace.n_expert, True)),
            hot_recall=_mean(_hot(c, trace.k)),
            overlap=_mean(_overlap_from(sh1, trace, 1, ph)),
            overlap_lag=_mean(_overlap_from(shl, trace, lag, ph)),
        )
    return TraceStats(
        summary=trace.summary(),
        lag=lag,
        window=min(window, trace.tokens),
        random_overlap=trace.k / trace.n_expert,
        layers=rows,
        phases=phases,
        notes=_notes(trace, lag),
    )


def _notes(trace: RoutingTrace, lag: int) -> list[str]:
    """Why ``summarize`` has no statistics for a phase, or no value (NaN) for an overlap."""
    notes: list[str] = []
    lags = sorted({1, lag})
    longest = _longest_run(trace, "all")
    where = (
        "tokens and the trace has"
        if trace.prompts == 1
        else "tokens in one prompt, the longest has"
    )
    short = [x for x in lags if longest <= x]
    for x in short:
        notes.append(f"overlap at lag {x} needs at least {x + 1} {where} {longest}: not computed")
    for ph, other in (("prefill", "decode"), ("decode", "prefill")):
        n = trace.phase_tokens(ph)
        if n == 0:
            notes.append(f"the trace has no {ph} tokens: per-phase statistics cover {other} only")
            continue
        run = _longest_run(trace, ph)
        for x in lags:
            if run <= x and x not in short:
                many = "" if trace.prompts == 1 else " in its longest prompt"
                notes.append(
                    f"{ph} has {run} token{'s' if run != 1 else ''}{many}, too few for overlap "
                    f"at lag {x}: not computed"
                )
    return notes


def _longest_run(trace: RoutingTrace, phase: str) -> int:
    return max((r.stop - r.start for r in trace.phase_runs(phase)), default=0)
