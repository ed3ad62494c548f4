"""Cost model against physical replay: predicted speedup of each layout over identity vs the
speedup measured by replaying its reads on the real file, cold (O_DIRECT), in the same run.

A synthetic qwen3moe model and a planted-cluster trace; a plan made on the first half of the
tokens, the replay on held-out tokens of the second half. Per round, ``replay_layouts`` reads
the tokens in chunks, every layout in turn (the order rotating), and right after each chunk
reads a shadow of it (half of every layout's requests in it, same sizes after O_DIRECT
widening, random offsets in the blocks' region, one stream per size), with the same engine and
queue depth; the surface is each
size's mean over its shadow reads: drift and other processes' I/O hit the prediction and every
layout alike. ``meas x`` is the median, over every chunk of every round, of identity's chunk
time over the layout's (each pair read moments apart, so a burst of another process's I/O that
hits one chunk moves one ratio, not the result); ``pred x`` the same median of the predicted
chunk times; ``diff`` their relative difference. ``pred us``/``meas us`` are medians over rounds
of the totals per token, and the last column the medians over rounds of the ratios of totals.
Prints the machine's load average too.

    .venv/bin/python benchmarks/bench_layout.py --dir /tmp/bench-layout
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import numpy as np

from headline import record
from moepack.checkpoint.model import MoeModel
from moepack.checkpoint.synth import SynthSpec, synth_model
from moepack.layout.coactivation_plan import plan_from_trace
from moepack.layout.cost import CostOptions, fit_surface
from moepack.layout.layout import LayoutOptions, place
from moepack.layout.replay import MeasureOptions, replay_layouts
from moepack.storage.modes import Mode
from moepack.trace import synth_trace

LAYOUTS = ["identity", "reorder", "fused", "expert-major", "reorder+expert-major"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=Path("/tmp/bench-layout"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--replay-tokens", type=int, default=200)
    ap.add_argument("--chunk-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--engine", default="pread")
    ap.add_argument("--queue-depth", type=int, default=1)
    ap.add_argument("--probe-share", type=float, default=0.5)
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / f"bench-{args.layers}x{args.experts}-{args.hidden}x{args.ffn}.gguf"
    if not path.exists():
        spec = SynthSpec(
            layers=args.layers,
            experts=args.experts,
            top_k=args.top_k,
            hidden=args.hidden,
            expert_ffn=args.ffn,
        )
        synth_model(path, spec)
    load_before = os.getloadavg()
    with MoeModel(path) as model:
        slice_kib = model.blocks[0].weight_tensors[0].slice_bytes / 1024
        trace = synth_trace(model, tokens=args.tokens, seed=1).bound_to(model)
        half = args.tokens // 2
        plan = plan_from_trace(model, trace.replace(ids=trace.ids[:half].copy())).plan
        held_out = np.asarray(trace.ids[half : half + args.replay_tokens], dtype=np.int64)
        blocks = trace.check_against(model)
        opts = CostOptions(queue_depth=args.queue_depth)
        placements = [place(model, n, LayoutOptions(plan=plan)) for n in LAYOUTS]
        pred_x: dict[str, list[float]] = {n: [] for n in LAYOUTS}
        meas_x: dict[str, list[float]] = {n: [] for n in LAYOUTS}
        paired_meas: dict[str, list[float]] = {n: [] for n in LAYOUTS}
        paired_pred: dict[str, list[float]] = {n: [] for n in LAYOUTS}
        pred_us: dict[str, list[float]] = {n: [] for n in LAYOUTS}
        meas_us: dict[str, list[float]] = {n: [] for n in LAYOUTS}
        fits = []
        for _ in range(args.rounds):
            got = replay_layouts(
                model,
                placements,
                held_out,
                blocks,
                cost=opts,
                measure=MeasureOptions(
                    args.engine,
                    Mode.DIRECT,
                    chunk_tokens=args.chunk_tokens,
                    probe=True,
                    probe_share=args.probe_share,
                ),
            )
            assert got.surface is not None
            fits.append(fit_surface(got.surface, args.queue_depth))
            by = {r.layout: r for r in got.results}
            base = by["identity"]
            for n, res in by.items():
                assert res.predicted_seconds is not None and base.predicted_seconds is not None
                pred_x[n].append(base.predicted_seconds / res.predicted_seconds)
                meas_x[n].append(base.seconds / res.seconds)
                pairs = zip(base.chunk_seconds, res.chunk_seconds, strict=True)
                paired_meas[n] += [b / m for b, m in pairs]
                pairs = zip(base.chunk_predicted, res.chunk_predicted, strict=True)
                paired_pred[n] += [b / p for b, p in pairs]
                pred_us[n].append(res.predicted_seconds / res.tokens * 1e6)
                meas_us[n].append(res.time_per_token * 1e6)
    load_after = os.getloadavg()
    med = statistics.median
    print(
        f"model {path.name}: {args.layers} MoE blocks x {args.experts} experts, top-{args.top_k}, "
        f"slices {slice_kib:.0f} KiB; {args.replay_tokens} held-out tokens in chunks of "
        f"{args.chunk_tokens}, O_DIRECT, {args.engine} qd{args.queue_depth}; medians of "
        f"{args.rounds} rounds, layouts and probe cells interleaved"
    )
    print(
        f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} "
        f"({os.cpu_count()} cores)"
    )
    print(
        f"surface fit per round: t_op {', '.join(f'{f.t_op * 1e6:.0f}' for f in fits)} us; "
        f"bandwidth {', '.join(f'{f.bandwidth / 1e9:.2f}' for f in fits)} GB/s"
    )
    print(
        f"{'layout':>22} {'pred us':>9} {'meas us':>9} {'pred x':>7} {'meas x':>7} {'diff':>7}"
        f" {'chunks':>7} {'totals pred/meas':>17}"
    )
    for n in LAYOUTS:
        px, mx = med(paired_pred[n]), med(paired_meas[n])
        print(
            f"{n:>22} {med(pred_us[n]):9.0f} {med(meas_us[n]):9.0f} {px:7.3f} {mx:7.3f} "
            f"{(px / mx - 1) * 100:+6.1f}% {len(paired_meas[n]):7d} "
            f"{med(pred_x[n]):8.3f}/{med(meas_x[n]):.3f}"
        )
    off = {n: med(paired_pred[n]) / med(paired_meas[n]) for n in LAYOUTS if n != "identity"}
    worst = max(off, key=lambda n: abs(off[n] - 1))
    record(
        "layout-model",
        title="Layout cost model against physical replay",
        what="predicted speedup over the file's order, over the measured one, the worst of "
        f"{len(off)} layouts ({worst})",
        ratio=off[worst],
        yardstick=f"the measured O_DIRECT replay ({args.engine}, QD {args.queue_depth})",
        yardstick_value=None,
        unit="",
        figures={f"{n} predicted / measured": r for n, r in off.items()}
        | {"rounds": args.rounds, "load before": load_before[0], "load after": load_after[0]},
        target="within 5 % for every layout (issue 11)",
        met=all(abs(r - 1) <= 0.05 for r in off.values()),
        detail=", ".join(f"{n} {100 * (r - 1):+.1f} %" for n, r in off.items()),
        model=f"synthetic qwen3moe, F32, {args.layers} MoE blocks × {args.experts} experts, "
        f"top-{args.top_k}, {slice_kib:.0f} KiB slices; {args.replay_tokens} held-out tokens",
    )


if __name__ == "__main__":
    main()
