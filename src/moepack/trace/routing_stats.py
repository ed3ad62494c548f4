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
never the whole trace, and never by the square of the expert count a header declares: pair
counts are kept sparse beyond ``pairs.DENSE_EXPERTS`` experts (``pairs.PairCounts``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from ..binding import shape_only_warnings
from ..errors import BadInput
from ..progress import NULL_PROGRESS, ProgressSink
from .core import RoutingTrace
from .pairs import PairCounts
from .stackdist import hit_curve, popcount, stack_distances, token_masks

MAX_LAG = 8
LIFT_THRESHOLD = 2.0
HOT_SHARE = 0.10
COVERAGE = (0.5, 0.9, 0.99)
MASK_WORDS = 1 << 22
"""Bitmask words (32 MiB) one step of ``reuse_of_ids`` holds."""


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


def reuse_of_ids(
    ids: np.ndarray,
    runs: list[slice],
    k: int,
    n_expert: int,
    max_lag: int = MAX_LAG,
    mask_words: int = MASK_WORDS,
) -> list[float]:
    """``reuse_in_runs`` from one layer's ids (``[tokens, k]``), their bitmasks made a chunk
    of tokens at a time (``mask_words`` words at most): memory is a chunk's masks, however
    many experts there are."""
    words = max(1, -(-n_expert // 64))
    step = max(max_lag + 1, mask_words // words)
    shared = np.zeros(max_lag, dtype=np.int64)
    pairs = np.zeros(max_lag, dtype=np.int64)
    for r in runs:
        for a in range(r.start, r.stop, step):
            lo, b = max(r.start, a - max_lag), min(r.stop, a + step)
            m = token_masks(np.asarray(ids[lo:b]), n_expert)
            for lag in range(1, max_lag + 1):
                t0 = max(a, r.start + lag)  # pairs (t - lag, t), t in [a, b), both in the run
                if b > t0:
                    both = m[t0 - lo : b - lo] & m[t0 - lo - lag : b - lo - lag]
                    shared[lag - 1] += int(popcount(both).sum())
                    pairs[lag - 1] += b - t0
    return [
        int(s) / (int(p) * k) if p else float("nan") for s, p in zip(shared, pairs, strict=True)
    ]


def lift(both: np.ndarray | PairCounts, counts: np.ndarray, tokens: int) -> Lift:
    """Co-activation lift over expert pairs that were both chosen at least once (``both``:
    the symmetric co-activation table, dense or as ``PairCounts``). Pairs never chosen
    together have lift 0; only the pairs that occur are held, the zeros are counted."""
    nan = float("nan")
    used = int((counts > 0).sum())
    if used < 2 or tokens == 0:
        return {"lift_above_2x": nan, "lift_p90": nan, "lift_p99": nan}
    pairs = (both if isinstance(both, PairCounts) else PairCounts.from_dense(both)).upper()
    a, b = pairs.i, pairs.j
    ratio = np.sort(pairs.count * float(tokens) / (counts[a].astype(np.float64) * counts[b]))
    n_pairs = used * (used - 1) // 2
    zeros = n_pairs - ratio.size
    return {
        "lift_above_2x": float((ratio > LIFT_THRESHOLD).sum() / n_pairs),
        "lift_p90": _percentile(ratio, zeros, 90),
        "lift_p99": _percentile(ratio, zeros, 99),
    }


def _percentile(ascending: np.ndarray, zeros: int, q: float) -> float:
    """``np.percentile`` (linear) of ``zeros`` zeros followed by ``ascending``, without
    making the zeros."""
    size = zeros + ascending.size
    h = (size - 1) * q / 100
    lo = int(np.floor(h))
    hi = min(lo + 1, size - 1)

    def at(i: int) -> float:
        return 0.0 if i < zeros else float(ascending[i - zeros])

    return float(np.percentile([at(lo), at(hi)], (h - lo) * 100))


def next_layer(
    joint: np.ndarray | PairCounts, counts: np.ndarray, there: np.ndarray, k: int
) -> NextLayer:
    """Predictability of layer ``l + 1``'s experts (``there``, ``[tokens, k]``) from layer
    ``l``'s, given ``joint`` (the pair counts of the two layers, dense or as ``PairCounts``)
    and ``counts`` (layer ``l``'s expert counts) over the same tokens."""
    pairs = joint if isinstance(joint, PairCounts) else PairCounts.from_dense(joint)
    tokens = there.shape[0]
    total = pairs.total()
    if tokens == 0 or total == 0:
        return NextLayer(
            next_mi_bits=float("nan"), next_best_map=float("nan"), next_baseline=float("nan")
        )
    p = pairs.count / total
    i, j = pairs.i, pairs.j
    pe = np.bincount(i, weights=p, minlength=pairs.n)
    pf = np.bincount(j, weights=p, minlength=pairs.n)
    mi = float((p * np.log2(p / (pe[i] * pf[j]))).sum())
    best = float(pairs.row_max().sum() / counts.sum())
    there_counts = np.bincount(there.ravel(), minlength=pairs.n)
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
    distances = stack_distances(here, n)
    # counts, co-activation and layer-to-layer pairs are sums over tokens: one pass per segment
    sums: dict[str, tuple[np.ndarray, PairCounts, PairCounts | None]] = {}
    for name, rng in _segments(trace, phases).items():
        ids = here[rng]
        both = PairCounts.of(ids, ids, n).off_diagonal()
        joint = PairCounts.of(ids, there[rng], n) if there is not None else None
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
                reuse=reuse_of_ids(here, trace.phase_runs(ph), k, n),
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
    warnings: list[str] = field(default_factory=list)  # bound to the model by shape only

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            **self.stats.to_json(),
            "plots": [str(p) for p in self.plots],
            "warnings": self.warnings,
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
    warnings: list[str] = []
    try:
        trace = load_trace(path, format=mod.NAME, n_expert=n_expert, model=opened, check=False)
        blocks = trace.check_against(opened) if opened is not None else None
        if opened is not None:
            warnings = shape_only_warnings("trace", trace.model_fingerprint, path, opened.path)
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
    return TraceStatsResult(format=mod.NAME, stats=stats, plots=plots, warnings=warnings)
