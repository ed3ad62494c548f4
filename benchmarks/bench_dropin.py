"""Drop-in layout rewrites against yardsticks measured in the same run.

A synthetic deepseek2 model (F32, 32 experts, hidden and expert width 1024: 384 MiB of expert
matrices per MoE block; ``--gib`` sets how many blocks) is rewritten, cold, in paired rounds:
  * ``cp`` + fsync of the model (coreutils, copying in the kernel): the yardstick;
  * ``repack --plan`` (reorder only) and ``repack --layout reorder+fused+pipeline --align 4096``,
    each / cp; and ``repack --undo`` of the layout rewrite / cp;
  * verify of the layout rewrite / coreutils ``cat`` of both files;
  * peak RSS (VmHWM) of the layout repack, of its verify and of the undo, each in a fresh child.
Every timed step starts cold (pages dropped and checked with cachestat, as ``bench_repack``).
The undo must give back the model byte for byte (compared at the end, not timed).

    .venv/bin/python benchmarks/bench_dropin.py [--gib 1] [--dir DIR] [--rounds 2]
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_repack import cat_both, child, cp_copy, drop_cache  # noqa: E402
from headline import record  # noqa: E402
from moepack.checkpoint import MoeModel  # noqa: E402
from moepack.checkpoint.synth import SynthSpec, synth_model  # noqa: E402
from moepack.layout.plan import LayerPlan, Plan, save_plan  # noqa: E402

LAYOUT = "reorder+fused+pipeline"


def spec_for(gib: float) -> SynthSpec:
    moe_blocks = max(1, round(gib * 1024 / 384))
    return SynthSpec(
        arch="deepseek2",
        layers=moe_blocks + 1,  # one dense leading block
        experts=32,
        top_k=4,
        hidden=1024,
        expert_ffn=1024,
        heads=8,
        head_dim=128,
        vocab=32000,
    )


def grouped_plan(model: MoeModel, seed: int) -> Plan:
    rng = np.random.default_rng(seed)
    g = max(model.n_expert_group, 1)
    layers = []
    for b in model.blocks:
        per = b.n_expert // g
        layers.append(
            LayerPlan(b.index, np.concatenate([rng.permutation(per) + i * per for i in range(g)]))
        )
    return Plan(layers, model.fingerprint)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gib", type=float, default=1.0, help="GiB of expert matrices")
    ap.add_argument("--dir", type=Path, default=Path("bench-data"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the generated model")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(args.dir).free < args.gib * 5 * 2**30:
        raise SystemExit(f"need {args.gib * 5:.0f} GiB free in {args.dir}")
    model = args.dir / f"dropin-{args.gib:g}g.gguf"
    if not model.exists():
        print(f"generating {model} ...", flush=True)
        synth_model(model, spec_for(args.gib))
    with MoeModel(model) as m:
        plan_path = args.dir / f"dropin-{args.gib:g}g.moeplan"
        save_plan(grouped_plan(m, 0), plan_path)
    copy, reord, laid, back = (
        args.dir / f"dropin-{k}.gguf" for k in ("copy", "reorder", "layout", "undo")
    )
    times: dict[str, list[float]] = {
        k: [] for k in ("cp", "reorder", "layout", "undo", "verify", "cat")
    }
    rss: dict[str, float] = {"layout": 0.0, "verify": 0.0, "undo": 0.0}
    load = "from moepack.layout.plan import load_plan\n"
    for _ in range(args.rounds):
        for p in (copy, reord, laid, back):
            p.unlink(missing_ok=True)
        drop_cache(model)
        times["cp"].append(cp_copy(model, copy))
        copy.unlink()
        drop_cache(model)
        t, _, _ = child(
            load + "from moepack.rewrite.repack import repack",
            f"repack({str(model)!r}, load_plan({str(plan_path)!r}), {str(reord)!r})",
        )
        times["reorder"].append(t)
        reord.unlink()
        drop_cache(model)
        t, _, r = child(
            load + "from moepack.rewrite.repack import repack",
            f"repack({str(model)!r}, load_plan({str(plan_path)!r}), {str(laid)!r}, "
            f"layout={LAYOUT!r}, alignment=4096)",
        )
        times["layout"].append(t)
        rss["layout"] = max(rss["layout"], r)
        drop_cache(model, laid)
        times["cat"].append(cat_both(model, laid))
        drop_cache(model, laid)
        t, _, r = child(
            "from moepack.rewrite.verify import verify",
            f"assert verify({str(model)!r}, {str(laid)!r}).ok",
        )
        times["verify"].append(t)
        rss["verify"] = max(rss["verify"], r)
        drop_cache(laid)
        t, _, r = child(
            "from moepack.rewrite.undo import undo", f"undo({str(laid)!r}, {str(back)!r})"
        )
        times["undo"].append(t)
        rss["undo"] = max(rss["undo"], r)
    identical = filecmp.cmp(model, back, shallow=False)

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))

    size = model.stat().st_size
    print(f"\nmodel {model} ({size / 2**30:.2f} GiB), {args.rounds} cold rounds")
    print(f"{'step':<44} {'median s':>9} {'ratio':>7}  yardstick")
    print(f"{'cp + fsync':<44} {statistics.median(times['cp']):9.2f} {1:7.2f}  -")
    rows = [
        ("repack --plan (reorder)", "reorder", "cp"),
        (f"repack --layout {LAYOUT} --align 4096", "layout", "cp"),
        ("repack --undo", "undo", "cp"),
        ("verify (layout rewrite)", "verify", "cat"),
    ]
    for label, key, base in rows:
        print(f"{label:<44} {statistics.median(times[key]):9.2f} {ratio(key, base):7.2f}  {base}")
    print(f"{'cat of both files':<44} {statistics.median(times['cat']):9.2f} {1:7.2f}  -")
    print(
        f"peak RSS: layout repack {rss['layout']:.0f} MB, verify {rss['verify']:.0f} MB, "
        f"undo {rss['undo']:.0f} MB; undo identical to the model: {identical}"
    )
    print("ratios are medians of per-round ratios; every step starts cold (cachestat-checked)")
    record(
        "dropin",
        title="Drop-in layout rewrite, cold",
        what=f"`repack --layout {LAYOUT} --align 4096`, time",
        ratio=ratio("layout", "cp"),
        yardstick="coreutils `cp` + fsync of the model",
        yardstick_value=statistics.median(times["cp"]),
        unit="s",
        figures={
            "layout repack s": statistics.median(times["layout"]),
            "cp + fsync s": statistics.median(times["cp"]),
            "reorder / cp": ratio("reorder", "cp"),
            "undo / cp": ratio("undo", "cp"),
            "verify / cat of both": ratio("verify", "cat"),
            "peak RSS layout repack MB": rss["layout"],
            "undo identical": identical,
            "rounds": args.rounds,
        },
        detail=f"undo {ratio('undo', 'cp'):.2f}×, {'byte-identical' if identical else 'NOT identical'}; "
        f"verify {ratio('verify', 'cat'):.2f}× `cat` of both",
        model=f"synthetic deepseek2, F32, 32 experts in 4 routing groups, {size / 2**30:.2f} GiB",
    )
    for p in (copy, reord, laid, back, plan_path) + (() if args.keep else (model,)):
        p.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
