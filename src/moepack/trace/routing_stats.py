"""``moepack trace stats``: what a routing trace says about caching and laying out experts.

Per trace layer and per phase (all tokens, and decode tokens when the trace has a prefill):

- **popularity**: entropy of the expert frequencies (normalised: 1.0 = uniform), the share of
  routings that land in the hottest 10 % of experts and in the hottest ``k``, and how many of
  the hottest experts cover 50 / 90 / 99 % of routings (hot-set coverage);
- **reuse**: mean share of a token's ``k`` experts that the token ``lag`` positions earlier
  also chose, lags 1 … 8 (independent uniform routing gives ``k / n_expert``);
- **co-activation lift**: for each pair of experts, how much more often one token chooses both
  than independence predicts (``tokens × both / (count_a × count_b)``); reported as the share
  of pairs above 2×, and the 90th and 99th percentile;
- **layer-to-layer predictability**: from the joint counts of (expert at layer ``l``, expert at
  ``l + 1``) of the same token, the mutual information in bits and the best-map accuracy (how
  often an expert's most frequent follower is among the next layer's choices), against the
  best constant guess (the next layer's most popular expert);
- **LRU hit rate** for every cache size ``1 … n_expert`` (per layer, experts cached per layer),
  exact, from stack distances (``stackdist``) over the whole stream in token order: for
  decode tokens the cache has seen the prefill (and, in a trace of several prompts, the
  prompts before), as a cache that serves the prompts one after another would.

Reuse pairs lie within one prompt's run of the phase: in a capture of several prompts a lag
never bridges two prompts, nor one prompt's prefill and the next one's decode.

Memory is bounded by one layer of the trace at a time (its ids, bitmasks and a sparse table),
never the whole trace.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from ..errors import BadInput
from ..progress import NULL_PROGRESS, ProgressSink
from .core import RoutingTrace, token_chunks
from .stackdist import hit_curve, popcount, stack_distances, token_masks

MAX_LAG = 8
LIFT_THRESHOLD = 2.0
HOT_SHARE = 0.10
COVERAGE = (0.5, 0.9, 0.99)


@dataclass
class LayerRoutingStats:
    """One trace layer in one phase (see the module docstring for each number)."""

    layer: int
    block: int | None
    entropy: float
    entropy_bits: float
    hot10_share: float
    hot_k_share: float
    experts_for: dict[str, int]  # "50%" / "90%" / "99%" -> hottest experts covering it
    reuse: list[float]  # lags 1 .. MAX_LAG
    lift_above_2x: float
    lift_p90: float
    lift_p99: float
    next_mi_bits: float | None  # None for the last layer
    next_best_map: float | None
    next_baseline: float | None
    lru_hit_rate: list[float]  # cache of 1 .. n_expert experts

    def to_json(self) -> dict[str, Any]:
        return {k: _clean(v) for k, v in vars(self).items()}


@dataclass
class PhaseRoutingStats:
    """Every layer of one phase, and the mean over layers."""

    phase: str
    tokens: int
    layers: list[LayerRoutingStats] = field(default_factory=list)

    def mean(self, name: str) -> float:
        values = [getattr(s, name) for s in self.layers if getattr(s, name) is not None]
        finite = [v for v in values if math.isfinite(v)]
        return float(np.mean(finite)) if finite else float("nan")

    def mean_curve(self, name: str) -> list[float]:
        rows = np.array([getattr(s, name) for s in self.layers], dtype=np.float64)
        if rows.ndim != 2:
            return []
        known = np.isfinite(rows)
        n = known.sum(axis=0)
        total = np.where(known, rows, 0.0).sum(axis=0)
        return [float(t / c) if c else float("nan") for t, c in zip(total, n, strict=True)]

    def to_json(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "tokens": self.tokens,
            "mean": {
                name: _clean(self.mean(name))
                for name in (
                    "entropy",
                    "hot10_share",
                    "hot_k_share",
                    "lift_above_2x",
                    "lift_p99",
                    "next_mi_bits",
                    "next_best_map",
                    "next_baseline",
                )
            },
            "mean_reuse": _clean(self.mean_curve("reuse")),
            "mean_lru_hit_rate": _clean(self.mean_curve("lru_hit_rate")),
            "layers": [s.to_json() for s in self.layers],
        }


@dataclass
class RoutingStats:
    """What ``moepack trace stats`` reports."""

    summary: dict[str, Any]
    random_reuse: float  # k / n_expert: reuse of independent uniform routing
    phases: dict[str, PhaseRoutingStats] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            **self.summary,
            "max_lag": MAX_LAG,
            "random_reuse": self.random_reuse,
            "phases": {name: p.to_json() for name, p in self.phases.items()},
            "notes": list(self.notes),
        }


def _clean(v: Any) -> Any:
    """NaN as None in JSON (it is not valid JSON)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, list):
        return [_clean(x) for x in v]
    return v


# ---------------------------------------------------------------------------- per measure


class Popularity(TypedDict):
    entropy: float
    entropy_bits: float
    hot10_share: float
    hot_k_share: float
    experts_for: dict[str, int]


class Lift(TypedDict):
    lift_above_2x: float
    lift_p90: float
    lift_p99: float


class NextLayer(TypedDict):
    next_mi_bits: float | None
    next_best_map: float | None
    next_baseline: float | None


def popularity(counts: np.ndarray, k: int) -> Popularity:
    """Entropy, hot shares and hot-set coverage of one layer's expert counts."""
    n = counts.size
    total = int(counts.sum())
    if total == 0:
        nan = float("nan")
        return {
            "entropy": nan,
            "entropy_bits": nan,
            "hot10_share": nan,
            "hot_k_share": nan,
            "experts_for": {f"{round(c * 100)}%": 0 for c in COVERAGE},
        }
    p = counts[counts > 0] / total
    bits = float(-(p * np.log2(p)).sum())
    hottest = np.sort(counts)[::-1]
    cum = np.cumsum(hottest) / total
    hot10 = max(1, math.ceil(HOT_SHARE * n))
    return {
        "entropy": bits / math.log2(n) if n > 1 else 0.0,
        "entropy_bits": bits,
        "hot10_share": float(cum[hot10 - 1]),
        "hot_k_share": float(cum[min(k, n) - 1]),
        "experts_for": {
            f"{round(c * 100)}%": int(np.searchsorted(cum, c - 1e-12) + 1) for c in COVERAGE
        },
    }


def reuse_at_lags(masks: np.ndarray, k: int, max_lag: int = MAX_LAG) -> list[float]:
    """Mean ``|S_t ∩ S_{t-lag}| / k`` for lags 1 … ``max_lag`` over the rows of ``masks``."""
    return reuse_in_runs(masks, [slice(0, masks.shape[0])], k, max_lag)


def reuse_in_runs(
    masks: np.ndarray, runs: list[slice], k: int, max_lag: int = MAX_LAG
) -> list[float]:
    """``reuse_at_lags`` over pairs of tokens that lie in one of ``runs`` (one prompt's
    tokens of a phase): a pair never bridges two prompts, or one's prefill and another's
    decode."""
    out = []
    for lag in range(1, max_lag + 1):
        shared, pairs = 0, 0
        for r in runs:
            m = masks[r]
            if m.shape[0] > lag:
                shared += int(popcount(m[lag:] & m[:-lag]).sum())
                pairs += m.shape[0] - lag
        out.append(shared / (pairs * k) if pairs else float("nan"))
    return out


def lift(both: np.ndarray, counts: np.ndarray, tokens: int) -> Lift:
    """Co-activation lift over expert pairs that were both chosen at least once."""
    used = np.flatnonzero(counts > 0)
    nan = float("nan")
    if used.size < 2 or tokens == 0:
        return {"lift_above_2x": nan, "lift_p90": nan, "lift_p99": nan}
    iu = np.triu_indices(used.size, 1)
    a, b = used[iu[0]], used[iu[1]]
    ratio = both[a, b] * float(tokens) / (counts[a].astype(np.float64) * counts[b])
    return {
        "lift_above_2x": float((ratio > LIFT_THRESHOLD).mean()),
        "lift_p90": float(np.percentile(ratio, 90)),
        "lift_p99": float(np.percentile(ratio, 99)),
    }


def next_layer(joint: np.ndarray, counts: np.ndarray, there: np.ndarray, k: int) -> NextLayer:
    """Predictability of layer ``l + 1``'s experts (``there``, ``[tokens, k]``) from layer
    ``l``'s, given ``joint`` (``pair_counts`` of the two layers) and ``counts`` (layer ``l``'s
    expert counts) over the same tokens."""
    tokens = there.shape[0]
    total = joint.sum()
    if tokens == 0 or total == 0:
        return NextLayer(
            next_mi_bits=float("nan"), next_best_map=float("nan"), next_baseline=float("nan")
        )
    p = joint / total
    pe, pf = p.sum(axis=1), p.sum(axis=0)
    nz = p > 0
    mi = float((p[nz] * np.log2(p[nz] / np.outer(pe, pf)[nz])).sum())
    best = float(joint.max(axis=1).sum() / counts.sum())
    there_counts = np.bincount(there.ravel(), minlength=joint.shape[1])
    return NextLayer(
        next_mi_bits=mi,
        next_best_map=best,
        next_baseline=float(there_counts.max() / tokens),
    )


# ---------------------------------------------------------------------------- the report


def routing_stats(
    trace: RoutingTrace,
    blocks: list[int] | None = None,
    progress: ProgressSink = NULL_PROGRESS,
) -> RoutingStats:
    """Every statistic of ``trace stats``, for all tokens and (with a prefill) decode tokens.
    ``blocks``: the GGUF block of each trace layer, when known (default: the trace's map)."""
    blocks = blocks if blocks is not None else trace.block_map
    notes: list[str] = []
    phases = ["all"]
    if trace.prefill_tokens and trace.decode_tokens:
        phases.append("decode")
    elif trace.prefill_tokens and not trace.decode_tokens:
        notes.append("the trace has no decode tokens: statistics cover all (prefill) tokens")
    longest = max(r.stop - r.start for r in trace.phase_runs("all"))
    if longest <= MAX_LAG:
        within = "" if trace.prompts == 1 else " within one prompt"
        notes.append(f"reuse at lags >= {longest} needs more tokens{within}: not computed (null)")
    result = RoutingStats(summary=trace.summary(), random_reuse=trace.k / trace.n_expert)
    for ph in phases:
        result.phases[ph] = PhaseRoutingStats(ph, trace.phase_tokens(ph))
    here = np.ascontiguousarray(trace.ids[:, 0, :])
    progress.start("routing statistics", trace.layers, unit="layers")
    try:
        for layer in range(trace.layers):
            here = _layer(trace, result, phases, blocks, layer, here)
            progress.advance(1)
    finally:
        progress.finish()
    result.notes = notes
    return result


def pair_counts(a: np.ndarray, b: np.ndarray, n_expert: int) -> np.ndarray:
    """``[n, n]``: for rows ``a[t]`` and ``b[t]`` (``[tokens, k]`` each), how many tokens
    chose expert ``i`` in ``a`` and ``j`` in ``b``, in bounded chunks of tokens."""
    k = a.shape[1]
    out = np.zeros(n_expert * n_expert, dtype=np.int64)
    for sl in token_chunks(a.shape[0], k * k):
        pairs = a[sl].astype(np.int64)[:, :, None] * n_expert + b[sl][:, None, :]
        out += np.bincount(pairs.ravel(), minlength=n_expert * n_expert)
    return out.reshape(n_expert, n_expert)


def _segments(trace: RoutingTrace, phases: list[str]) -> dict[str, slice | np.ndarray]:
    """Disjoint token rows whose sums give every phase: prefill and decode, or all."""
    if "decode" in phases:
        return {"prefill": trace.phase_rows("prefill"), "decode": trace.phase_rows("decode")}
    return {"all": trace.phase_rows("all")}


def _layer(
    trace: RoutingTrace,
    result: RoutingStats,
    phases: list[str],
    blocks: list[int] | None,
    layer: int,
    here: np.ndarray,
) -> np.ndarray:
    """Add ``layer``'s statistics to every phase of ``result``; returns the next layer's ids
    (read once, used as this layer's follower and then as the next ``here``)."""
    n, k = trace.n_expert, trace.k
    there = np.ascontiguousarray(trace.ids[:, layer + 1, :]) if layer + 1 < trace.layers else None
    masks = token_masks(here, n)
    distances = stack_distances(here, n)
    # counts, co-activation and layer-to-layer pairs are sums over tokens: one pass per segment
    sums: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]] = {}
    for name, rng in _segments(trace, phases).items():
        ids = here[rng]
        both = pair_counts(ids, ids, n)
        np.fill_diagonal(both, 0)
        joint = pair_counts(ids, there[rng], n) if there is not None else None
        sums[name] = (np.bincount(ids.ravel(), minlength=n), both, joint)
    if "decode" in phases:
        pre, dec = sums["prefill"], sums["decode"]
        sums["all"] = (
            pre[0] + dec[0],
            pre[1] + dec[1],
            pre[2] + dec[2] if pre[2] is not None and dec[2] is not None else None,
        )
    for ph in phases:
        rng = trace.phase_rows(ph)
        counts, both, joint = sums[ph]
        follow = (
            next_layer(joint, counts, there[rng], k)
            if joint is not None and there is not None
            else NextLayer(next_mi_bits=None, next_best_map=None, next_baseline=None)
        )
        result.phases[ph].layers.append(
            LayerRoutingStats(
                layer=layer,
                block=blocks[layer] if blocks is not None else None,
                **popularity(counts, k),
                reuse=reuse_in_runs(masks, trace.phase_runs(ph), k),
                **lift(both, counts, trace.phase_tokens(ph)),
                **follow,
                lru_hit_rate=[float(v) for v in hit_curve(distances[rng], n)],
            )
        )
    return there if there is not None else here


@dataclass
class TraceStatsResult:
    """``moepack trace stats``: the statistics, the trace's format, and the plots written."""

    format: str
    stats: RoutingStats
    plots: list[Path] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            **self.stats.to_json(),
            "plots": [str(p) for p in self.plots],
        }


def trace_stats(
    path: str | os.PathLike[str],
    *,
    format: str | None = None,
    n_expert: int | None = None,
    model: str | os.PathLike[str] | None = None,
    plot_dir: str | os.PathLike[str] | None = None,
    heatmap_layer: int = 0,
    progress: ProgressSink = NULL_PROGRESS,
) -> TraceStatsResult:
    """Read and validate a trace (checked against ``model`` when given: its blocks label the
    layers), compute ``routing_stats`` and, with ``plot_dir``, write the PNGs there."""
    from ..checkpoint.model import MoeModel
    from .formats import detect_format, get_format, load_trace

    mod = get_format(format) if format else detect_format(path)
    opened = MoeModel(model) if model is not None else None
    try:
        trace = load_trace(path, format=mod.NAME, n_expert=n_expert, model=opened, check=False)
        blocks = trace.check_against(opened) if opened is not None else None
    finally:
        if opened is not None:
            opened.close()
    if plot_dir is not None and not 0 <= heatmap_layer < trace.layers:
        raise BadInput(
            f"heatmap layer {heatmap_layer} does not exist (0..{trace.layers - 1})", trace.path
        )
    stats = routing_stats(trace, blocks, progress)
    plots: list[Path] = []
    if plot_dir is not None:
        from .stats_plots import write_stats_plots

        plots = write_stats_plots(stats, trace, plot_dir, heatmap_layer)
    return TraceStatsResult(format=mod.NAME, stats=stats, plots=plots)
