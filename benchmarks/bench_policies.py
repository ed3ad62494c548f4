"""Cache policies and predictors: speed at the issue's scale, and mbolt's two findings
checked here (cross-layer prediction a null at 51 % coverage with 2x over-fetch; plain LRU
beating every pinned hot set).

  * speed: every policy over a synthetic 100k-token x 48-layer x top-8-of-128 trace, against
    a plain Python ``OrderedDict`` LRU loop over the same accesses (the yardstick, timed in
    the same run), and the exact stack distances that give LRU at every size in one pass;
  * findings: on (a) llama.cpp's routing captured from a routing-structured synthetic model
    (``moepack.demo``'s ROUTED_SPEC: 16 prompts of 128 tokens, 32 decoded after each; skipped
    without llama.cpp)
    and (b) a ``trace synth`` trace, predictors' recall at budgets k and 2k on held-out
    prompts, and LRU vs pinned hot sets (25/50/75 % of the slots) vs Belady at 1x, 2x, 4x
    top-k slots per layer, on the held-out prompts (pinned sets learned on the others).

    .venv/bin/python benchmarks/bench_policies.py --dir /tmp/bench-policies [--tokens 100000]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from bench_trace_stats import plain_lru_hits  # the same OrderedDict yardstick
from headline import record
from moepack.checkpoint.model import MoeModel
from moepack.checkpoint.synth import llama_cpp_available
from moepack.demo import DEMO_PROMPTS, PROMPT_TOKENS, ROUTED_SPEC
from moepack.planted.synth_with_trace import synth_model_with_trace
from moepack.stream.forecast import evaluate, holdout
from moepack.stream.simulate import HitRates, layer_hits, lru_hits_by_size
from moepack.trace import load_trace, synth_trace
from moepack.trace.cache_policy import POLICIES
from moepack.trace.core import RoutingTrace


def speed(tokens: int, layers: int) -> None:
    trace = synth_trace(tokens=tokens, layers=layers, n_expert=128, top_k=8, seed=0)
    cap = 32
    t0 = time.perf_counter()
    base_hits = sum(plain_lru_hits(np.asarray(trace.ids[:, i, :]), cap) for i in range(layers))
    base = time.perf_counter() - t0
    print(f"speed: {tokens:,} tokens x {layers} layers x top-8 of 128, {cap} slots per layer")
    print(f"  plain OrderedDict LRU loop {base:7.1f} s")
    t0 = time.perf_counter()
    for i in range(layers):
        lru_hits_by_size(np.asarray(trace.ids[:, i, :]), 128, list(range(8, 129)))
    curve = time.perf_counter() - t0
    print(f"  LRU at all 121 sizes (stack distances) {curve:7.1f} s  ratio {curve / base:5.2f}")
    policy_ratios: dict[str, float] = {}
    for p in POLICIES:
        t0 = time.perf_counter()
        hits = 0
        for i in range(layers):
            ids = np.asarray(trace.ids[:, i, :])
            hits += int(layer_hits(p, ids, cap, 128, p.fit(ids, 128, cap)).sum())
        dt = time.perf_counter() - t0
        note = "  (equals the plain loop)" if p.name == "lru" and hits == base_hits else ""
        policy_ratios[p.name] = dt / base
        print(
            f"  {p.name:>10} {dt:7.1f} s  ratio {dt / base:5.2f}  hit {hits / trace.ids.size:.4f}"
            f"{note}"
        )
    record(
        "cache-policies",
        title="Cache policy simulation",
        what="LRU hit rates at all 121 cache sizes (stack distances), time",
        ratio=curve / base,
        yardstick="a Python `OrderedDict` LRU loop at one size",
        yardstick_value=base,
        unit="s",
        figures={"stack distances s": curve, "OrderedDict loop s": base, **policy_ratios},
        detail=", ".join(f"{k} {v:.2f}×" for k, v in policy_ratios.items()),
        model=f"{tokens:,} tokens × {layers} layers × top-8 of 128, {cap} slots per layer",
    )


def captured(folder: Path) -> RoutingTrace | None:
    if not llama_cpp_available():
        print("llama.cpp is not installed: the captured-trace half is skipped")
        return None
    from moepack.llama.runtime.capture import CaptureOptions, capture_trace
    from moepack.llama.runtime.prompts import read_prompt_file

    model, prompts = folder / "routed.gguf", folder / "routed.prompts.jsonl"
    trace = folder / "routed-decode.moetrace"
    if not trace.exists():
        synth_model_with_trace(
            model,
            ROUTED_SPEC,
            prompts_out=prompts,
            n_prompts=DEMO_PROMPTS,
            prompt_tokens=PROMPT_TOKENS,
        )
        capture_trace(
            model, trace, read_prompt_file(prompts), CaptureOptions(n_predict=32, threads=2)
        )
    with MoeModel(model) as m:
        return load_trace(trace, model=m)


def findings(label: str, trace: RoutingTrace) -> None:
    k = trace.k
    r = evaluate(
        trace, ["frequency", "sticky", "markov", "cross-layer", "sticky+cross-layer"], [k, 2 * k]
    )
    print(
        f"{label}: {trace.tokens} tokens, {trace.layers} layers, top-{k} of {trace.n_expert}, "
        f"{trace.prompts} prompts; held out {r.split.eval_rows.size} tokens "
        f"({'whole prompts' if r.split.by_prompts else 'last quarter'})"
    )
    for s in r.scores:
        print(
            f"  {s.predictor:>20} budget {s.budget:3}: recall {100 * s.recall:5.1f} %  "
            f"precision {100 * s.precision:5.1f} %"
        )
    split = holdout(trace)  # pinned sets learned on the training prompts, scored on the rest
    decode = trace.phase_mask("decode")[split.eval_rows]
    names = ["lru", "pinned-25", "pinned-50", "pinned-75", "slru", "lfu", "belady"]
    print("  hit rate on the held-out tokens (all / decode) by slots per layer:")
    for mult in (1, 2, 4):
        cap = min(trace.n_expert, mult * k)
        cells = []
        for name in names:
            p = POLICIES.get(name)
            total = HitRates(0, 0, 0, 0)
            for i in range(trace.layers):
                ids = np.asarray(trace.ids[split.eval_rows, i, :])
                learned = p.fit(np.asarray(trace.ids[split.train_rows, i, :]), trace.n_expert, cap)
                h = layer_hits(p, ids, cap, trace.n_expert, learned)
                total = total + HitRates.of(h, decode)
            d = total.decode
            cells.append(
                f"{name} {100 * total.lifetime:.1f}/{'-' if d is None else f'{100 * d:.1f}'}"
            )
        print(f"    {cap:3} slots: " + "  ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/bench-policies"))
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--skip-speed", action="store_true")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    if not args.skip_speed:
        speed(args.tokens, args.layers)
    cap = captured(args.dir)
    if cap is not None:
        findings("captured (llama.cpp, routing-structured model)", cap)
    synth = synth_trace(
        tokens=8192, layers=24, n_expert=64, top_k=8, prefill_tokens=0, seed=5
    ).replace(segments=[(i * 512, 64, 448) for i in range(16)])
    findings("trace synth (planted clusters)", synth)


if __name__ == "__main__":
    main()
