"""``trace stats`` against yardsticks measured in the same run.

For a synthetic trace (default 100k tokens x 48 layers x top-8 of 128 experts, Qwen3-30B-like):
  * ``routing_stats`` (everything ``trace stats`` reports, all tokens and decode tokens) /
    ``summarize`` (everything ``trace info`` shows) on the same trace;
  * the exact LRU curve of one layer for *every* cache size from stack distances / a plain
    Python ``OrderedDict`` LRU simulation of the same layer for *one* cache size (k), whose
    hit rate the curve must reproduce exactly (checked);
  * ``routing_stats`` on the same ids cut into ``--prompts`` prompts (prompt segments, each
    with its own prefill) / on the one-prompt trace: what per-prompt phases cost.
Each time is the best of ``--repeat`` runs.

    .venv/bin/python benchmarks/bench_trace_stats.py [--tokens 100000] [--layers 48] [--prompts 64]
"""

from __future__ import annotations

import argparse
import time
from collections import OrderedDict

import numpy as np

from bench_trace import best  # the same best-of-N timer (benchmarks/ is on sys.path)
from headline import record
from moepack.trace import summarize, synth_trace
from moepack.trace.routing_stats import routing_stats
from moepack.trace.stackdist import hit_curve, stack_distances


def plain_lru_hits(ids: np.ndarray, capacity: int) -> int:
    """Hits of a plain Python ``OrderedDict`` LRU of ``capacity`` over ``ids`` row by row:
    the yardstick every faster LRU here is checked and timed against."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for row in ids.tolist():
        for e in row:
            if e in cache:
                hits += 1
                cache.move_to_end(e)
            else:
                cache[e] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits


def lru_hit_rate(ids: np.ndarray, capacity: int) -> float:
    return plain_lru_hits(ids, capacity) / ids.size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    trace = synth_trace(
        tokens=args.tokens,
        layers=args.layers,
        n_expert=args.experts,
        top_k=args.top_k,
        prefill_tokens=args.tokens // 20,
        seed=0,
    )
    shape = f"{args.tokens:,} tokens x {args.layers} layers x top-{args.top_k} of {args.experts}"
    print(f"trace: {shape}")
    t_stats = best(lambda: routing_stats(trace), args.repeat)
    t_info = best(lambda: summarize(trace), args.repeat)
    print(
        f"routing_stats {t_stats:8.2f} s   summarize {t_info:8.2f} s   ratio {t_stats / t_info:.2f}"
    )
    per = args.tokens // args.prompts
    segments = [
        (
            i * per,
            per // 20 or 1,
            (per if i < args.prompts - 1 else args.tokens - i * per) - (per // 20 or 1),
        )
        for i in range(args.prompts)
    ]
    prompts = trace.replace(prefill_tokens=0, segments=segments)
    t_seg = best(lambda: routing_stats(prompts), args.repeat)
    print(
        f"routing_stats, {args.prompts} prompts {t_seg:8.2f} s   one prompt {t_stats:8.2f} s   "
        f"ratio {t_seg / t_stats:.2f}"
    )
    ids = np.asarray(trace.ids[:, 0, :])
    t_curve = best(lambda: hit_curve(stack_distances(ids, args.experts), args.experts), args.repeat)
    t0 = time.perf_counter()
    simulated = lru_hit_rate(ids, args.top_k)
    t_sim = time.perf_counter() - t0
    curve = hit_curve(stack_distances(ids, args.experts), args.experts)
    assert curve[args.top_k - 1] == simulated, (curve[args.top_k - 1], simulated)
    print(
        f"LRU curve, all {args.experts} sizes {t_curve:8.3f} s   Python LRU, 1 size "
        f"{t_sim:8.3f} s   ratio {t_curve / t_sim:.3f}   (hit rate at {args.top_k}: "
        f"{simulated:.4f}, equal)"
    )
    record(
        "trace-stats",
        title="`trace stats`: the exact LRU curve",
        what=f"the exact LRU hit rate at every cache size (1 … {args.experts}) of one layer, time",
        ratio=t_curve / t_sim,
        yardstick="a Python `OrderedDict` LRU at one cache size",
        yardstick_value=t_sim,
        unit="s",
        figures={
            "LRU curve s": t_curve,
            "Python LRU s": t_sim,
            "routing_stats s": t_stats,
            "summarize s": t_info,
            "routing_stats / summarize": t_stats / t_info,
            f"routing_stats, {args.prompts} prompts / one": t_seg / t_stats,
        },
        detail="the same hit rate as the simulation (asserted); all of `trace stats` costs "
        f"{t_stats / t_info:.2f}× `trace info`'s summarize",
        model=f"{shape} experts (synthetic, 5 % prefill)",
    )


if __name__ == "__main__":
    main()
