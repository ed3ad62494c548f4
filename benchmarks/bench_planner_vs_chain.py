"""The planner against two chains: mbolt's idea of ``chain_perm`` (a greedy max-co-activation
path from the hottest expert, each step following the last placed expert), reimplemented here
over the whole block (mbolt first splits a block into clusters; this comparison does not), and
the chain ``plan`` writes (the same, following the last k placed), on planted traces whose
clusters are larger than top-k; ``--mix P`` routes only a share P of the (token, layer) pairs
within a cluster, the rest anywhere (weak structure). All are judged on held-out tokens, by
requests and by modelled read time on a surface (a measured one with --surface, else a linear
model of a device with 80 us per request and 2 GB/s, said so in the output).

    .venv/bin/python benchmarks/bench_planner_vs_chain.py --dir /tmp/bench-planner
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from headline import record
from moepack.checkpoint.model import MoeModel
from moepack.checkpoint.synth import SynthSpec, synth_model
from moepack.layout.planner import (
    SearchOptions,
    _coactivation,
    _slots,
    gap_slots,
    order_cost,
    plan_model,
    run_cost_table,
)
from moepack.storage.surface import Surface, SurfaceCell
from moepack.trace.chain import greedy_chain
from moepack.trace.core import RoutingTrace


def path_chain(coact: np.ndarray, heat: np.ndarray) -> np.ndarray:
    """Start at the hottest expert; repeatedly append the unplaced expert most co-activated
    with the last one placed (ties by heat)."""
    n = len(heat)
    placed = np.zeros(n, dtype=bool)
    cur = int(np.argmax(heat))
    order = [cur]
    placed[cur] = True
    for _ in range(n - 1):
        score = np.where(placed, -np.inf, coact[cur] + 1e-9 * heat)
        cur = int(np.argmax(score))
        order.append(cur)
        placed[cur] = True
    return np.asarray(order, dtype=np.int64)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=Path("/tmp/bench-planner"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--cluster", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=20_000)
    ap.add_argument("--surface", type=Path, default=None)
    ap.add_argument("--merge-gap", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--skew",
        type=float,
        default=0.0,
        help="Zipf exponent of the experts' popularity within a cluster (0: uniform)",
    )
    ap.add_argument("--trace-seed", type=int, default=0, help="Seed of the planted routing.")
    ap.add_argument(
        "--mix",
        type=float,
        default=1.0,
        help="Share of (token, layer) pairs routed within a cluster; the rest anywhere.",
    )
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / f"chain-{args.layers}x{args.experts}-top{args.top_k}.gguf"
    if not path.exists():
        synth_model(
            path,
            SynthSpec(
                layers=args.layers,
                experts=args.experts,
                top_k=args.top_k,
                hidden=256,
                expert_ffn=128,
                heads=1,
                kv_heads=1,
            ),
        )
    if args.surface:
        surface, label = Surface.load(args.surface), str(args.surface)
    else:
        sizes = [4096 << i for i in range(12)]
        surface = Surface([SurfaceCell(s, 1, s / (80e-6 + s / 2e9)) for s in sizes])
        label = "linear model: 80 us/request, 2 GB/s"
    rng = np.random.default_rng(args.trace_seed)
    n, k, c = args.experts, args.top_k, args.cluster
    groups = np.stack([rng.permutation(n) for _ in range(args.layers)]).reshape(args.layers, -1, c)
    pick = rng.integers(n // c, size=(args.tokens, args.layers))
    # k distinct members of the cluster, member j drawn with weight (j + 1) ** -skew
    # (Gumbel top-k: sampling without replacement in proportion to the weights)
    logw = -args.skew * np.log(np.arange(1, c + 1))
    keys = logw + rng.gumbel(size=(args.tokens, args.layers, c))
    within = np.argsort(-keys, axis=2)[:, :, :k]
    ids = groups[np.arange(args.layers)[None, :, None], pick[:, :, None], within]
    anywhere = rng.random((args.tokens, args.layers)) >= args.mix
    for layer in range(args.layers):  # k distinct experts of all n, uniformly
        rows = np.flatnonzero(anywhere[:, layer])
        keys = rng.gumbel(size=(rows.size, n))
        ids[rows, layer] = np.argsort(-keys, axis=1)[:, :k]
    trace = RoutingTrace(ids=ids.astype(np.uint8), n_expert=n)
    split = int(args.tokens * 0.75)
    totals = {n: [0.0, 0.0] for n in ("identity", "planted", "chain", "plan chain", "planner")}
    with MoeModel(path) as m:
        search = SearchOptions(holdout=0.25, seed=args.seed, merge_gap=args.merge_gap)
        result = plan_model(m, trace, search, surface=surface)
        for layer, b in enumerate(m.moe_block_indices):
            block = m.block(b)
            train, held = ids[:split, layer, :], ids[split:, layer, :]
            gap = gap_slots(block, args.merge_gap, surface, 1)
            req = run_cost_table(block, n, None, 1)
            tim = run_cost_table(block, n, surface, 1)
            coact, heat = _coactivation(train, n), np.bincount(train.ravel(), minlength=n)
            perms = {
                "identity": np.arange(n),
                "planted": groups[layer].ravel(),
                "chain": path_chain(coact, heat),
                "plan chain": greedy_chain(coact.astype(np.int64), heat, k),
                "planner": result.blocks[layer].perm,
            }
            for name, perm in perms.items():
                totals[name][0] += order_cost(held, _slots(perm), req, gap)
                totals[name][1] += order_cost(held, _slots(perm), tim, gap)
    held_tokens = args.tokens - split
    print(
        f"{args.layers} blocks x {n} experts, top-{k}, planted clusters of {c}; planned on "
        f"{split:,} tokens, judged on {held_tokens:,} held-out; surface: {label}; "
        f"merge gap {args.merge_gap} slices (read through where cheaper); popularity within "
        f"a cluster Zipf {args.skew:g}; routed within a cluster {args.mix:g}; trace seed "
        f"{args.trace_seed}, planner seed {args.seed}"
    )
    print(f"{'order':>10} {'requests/token':>15} {'modelled us/token':>18} {'time gain':>10}")
    for name, (r, t) in totals.items():
        gain = totals["identity"][1] / t
        print(f"{name:>10} {r / held_tokens:15.2f} {t / held_tokens * 1e6:18.1f} {gain:9.3f}x")
    won: dict[str, int] = {}
    for planned in result.blocks:
        way = getattr(planned, "won", None) or f"{planned.candidate} (this planner does not say)"
        won[way] = won.get(way, 0) + 1
    print("planner's ways, chosen on the training tokens:", won)
    gains = {name: totals["identity"][1] / t for name, (_, t) in totals.items()}
    record(
        "planner-vs-chain",
        title="Planner against `plan`'s chain",
        what="modelled read-time gain on held-out tokens",
        ratio=gains["planner"] / gains["plan chain"],
        yardstick=f"`plan`'s own greedy chain ({gains['plan chain']:.3f}× the file's order)",
        yardstick_value=None,
        unit="",
        figures={f"{name} requests/token": r / held_tokens for name, (r, _) in totals.items()}
        | {f"{name} time gain": g for name, g in gains.items()},
        target="never behind `plan`'s chain (issue 25)",
        met=gains["planner"] >= gains["plan chain"],
        detail=f"mbolt's chain {gains['chain']:.3f}×, the planner {gains['planner']:.3f}×",
        model=f"{n} experts, top-{k}, planted clusters of {c}, `--mix {args.mix:g}`, "
        f"`--skew {args.skew:g}`, trace seed {args.trace_seed}; {label}",
    )


if __name__ == "__main__":
    main()
