"""Cost model against physical replay: predicted speedup of each layout over identity vs the
speedup measured by replaying its reads on the real file, cold (O_DIRECT), in the same run.

A synthetic qwen3moe model and a planted-cluster trace; the surface is probed on the model file
itself first (same engine, mode and queue depth as the replay); then the layouts' reads are
replayed in interleaved rounds and each layout's median time is taken. Prints per layout the
predicted and measured time per token, both speedups and their relative difference.

    .venv/bin/python benchmarks/bench_layout.py --dir /tmp/bench-layout
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np

from moepack.checkpoint.model import MoeModel
from moepack.checkpoint.synth import SynthSpec, synth_model
from moepack.layout.coactivation_plan import plan_from_trace
from moepack.layout.cost import CostOptions, layout_cost
from moepack.layout.layout import LayoutOptions, place
from moepack.layout.replay import replay
from moepack.storage.modes import Mode
from moepack.storage.probe import run_probe
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
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--engine", default="pread")
    ap.add_argument("--queue-depth", type=int, default=1)
    ap.add_argument("--cell-seconds", type=float, default=0.3)
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
    with MoeModel(path) as model:
        slice_kib = model.blocks[0].weight_tensors[0].slice_bytes / 1024
        trace = synth_trace(model, tokens=args.tokens, seed=1).bound_to(model)
        half = args.tokens // 2
        plan = plan_from_trace(model, trace.replace(ids=trace.ids[:half].copy())).plan
        held_out = np.asarray(trace.ids[half : half + args.replay_tokens], dtype=np.int64)
        blocks = trace.check_against(model)
        sizes = [4096 << i for i in range(11)]  # 4 KiB .. 4 MiB
        opts = CostOptions(queue_depth=args.queue_depth)
        placements = {n: place(model, n, LayoutOptions(plan=plan)) for n in LAYOUTS}
        # per round: a fresh surface (this device drifts by 2x within a minute), then every
        # layout replayed in alternating order with that surface's prediction beside it
        pred_x: dict[str, list[float]] = {n: [] for n in LAYOUTS}
        meas_x: dict[str, list[float]] = {n: [] for n in LAYOUTS}
        pred_us: dict[str, list[float]] = {n: [] for n in LAYOUTS}
        meas_us: dict[str, list[float]] = {n: [] for n in LAYOUTS}
        fits = []
        for r in range(args.rounds):
            surface = run_probe(
                path,
                engine=args.engine,
                mode=Mode.DIRECT,
                sizes=sizes,
                depths=[args.queue_depth],
                cell_seconds=args.cell_seconds,
                repeats=1,
            ).surface
            fit = layout_cost(placements["identity"], held_out[:1], blocks, opts, surface).fit
            assert fit is not None
            fits.append(fit)
            got = {}
            for n in LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]:
                got[n] = replay(
                    model, placements[n], held_out, blocks, opts, surface, args.engine, Mode.DIRECT
                )
            base = got["identity"]
            for n, res in got.items():
                assert res.predicted_seconds is not None and base.predicted_seconds is not None
                pred_x[n].append(base.predicted_seconds / res.predicted_seconds)
                meas_x[n].append(base.seconds / res.seconds)
                pred_us[n].append(res.predicted_seconds / res.tokens * 1e6)
                meas_us[n].append(res.time_per_token * 1e6)
    med = statistics.median
    print(
        f"model {path.name}: {args.layers} MoE blocks x {args.experts} experts, top-{args.top_k}, "
        f"slices {slice_kib:.0f} KiB; {args.replay_tokens} held-out tokens, O_DIRECT, "
        f"{args.engine} qd{args.queue_depth}; medians of {args.rounds} rounds, each a fresh "
        "probe then every layout replayed"
    )
    print(
        f"surface fit per round: t_op {', '.join(f'{f.t_op * 1e6:.0f}' for f in fits)} us; "
        f"bandwidth {', '.join(f'{f.bandwidth / 1e9:.2f}' for f in fits)} GB/s"
    )
    print(f"{'layout':>22} {'pred us':>9} {'meas us':>9} {'pred x':>7} {'meas x':>7} {'diff':>7}")
    for n in LAYOUTS:
        diffs = [p / m - 1 for p, m in zip(pred_x[n], meas_x[n], strict=True)]
        print(
            f"{n:>22} {med(pred_us[n]):9.0f} {med(meas_us[n]):9.0f} {med(pred_x[n]):7.3f} "
            f"{med(meas_x[n]):7.3f} {med(diffs) * 100:+6.1f}%"
        )


if __name__ == "__main__":
    main()
