"""What llama.cpp's repacked Q4 kernels are worth when the model fits: ``defaults`` (experts and
dense weights repacked at load) against ``mapped`` (nothing repacked) and ``experts-mapped``
(experts in the file's mapping, dense weights repacked), Q4_K_M and Q4_0, prefill and cached
decode, 1 and 2 threads, printed as ratios against ``defaults`` measured in the same run.

The model: a synthetic qwen3moe, 8 layers x 32 experts, top-8, hidden 1024, expert FFN 512,
with planted routing (written once into ``--dir``, Q4_K_M through llama.cpp's quantiser). Every measurement is
a fresh ``moepack run`` worker (``run_model``) on the fully cached file: a prompt of
``--prompt-tokens`` characters, then ``--tokens`` tokens of the text after it, decoded one at a
time (``continuation``: the same tokens under every placement, so their logits compare); placements take turns in every
round, their order reversed each round, and each cell is the median over ``--rounds``.
Also per placement: the anonymous memory the load took (``weights.anon_bytes_of_load``) and
the largest logit difference from ``defaults`` (the repacked kernels sum in another order).

    .venv/bin/python benchmarks/bench_placement.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import numpy as np

from headline import record
from moepack.checkpoint.routing import RoutingSpec
from moepack.checkpoint.synth import SynthSpec, synth_model
from moepack.llama.runtime.run import RunOptions, run_model

PLACEMENTS = ("defaults", "experts-mapped", "mapped")
TYPES = ("Q4_K_M", "Q4_0")
ROUTING = "cluster=8,stay=0.8,coupling=0.95,skew=1"
"""Planted routing (as ``bench_run.py``'s): a random router's near-ties flip under the
repacked kernels' other summation order, and one flipped expert moves the logits by far more
than the kernels do (8 layers, random routing: 21 % of the token x layer sets differed)."""
WORDS = "the quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing"


def model_for(folder: Path, weight_type: str) -> Path:
    path = folder / f"placement-planted-{weight_type}.gguf"
    if not path.exists():
        spec = SynthSpec(
            layers=8,
            experts=32,
            top_k=8,
            hidden=1024,
            expert_ffn=512,
            heads=8,
            kv_heads=2,
            head_dim=128,
            vocab=512,
            context=2048,
            weight_type=weight_type,
            routing=RoutingSpec.parse(ROUTING),
        )
        synth_model(path, spec)
    return path


def prompt_of(tokens: int) -> str:
    """Text of about ``tokens`` tokens of the synthetic vocabulary (a byte a token or so)."""
    text = WORDS
    while len(text) < tokens:
        text += " " + WORDS
    return text[:tokens]


def one(path: Path, placement: str, threads: int, args: argparse.Namespace, logits: Path):
    options = RunOptions(n_predict=args.tokens, threads=threads, n_ctx=2048, batch=512,
                         placement=placement, spin=args.spin)  # fmt: skip
    text = prompt_of(args.prompt_tokens + 4 * args.tokens)
    # decode follows the text (the same tokens under every placement), so logits compare
    cut = args.prompt_tokens
    r = run_model(path, text[:cut], options, logits_out=logits, continuation=text[cut:])
    assert r.weights is not None
    args.seen_prompt_tokens = r.prompt_tokens
    return r.prefill.tokens_per_second, r.decode.tokens_per_second, r.weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/moepack-bench-placement"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per run")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--spin", type=int, default=None,
                    help="GOMP_SPINCOUNT of the workers (a loaded machine: 2 spinning threads "
                    "on 2 cores wait for each other's time slices)")  # fmt: skip
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    threads = [int(t) for t in args.threads.split(",")]
    cells: dict[tuple[str, int], dict[str, dict[str, float]]] = {}  # per type and threads
    print(f"load average {os.getloadavg()[0]:.2f} at the start")
    print(
        f"{'type':7} {'thr':>3} {'placement':15} {'prefill t/s':>11} {'x':>5} "
        f"{'decode t/s':>10} {'x':>5} {'anon MB':>8} {'max |dlogit|':>12}  repacked"
    )
    for wtype in args.types.split(","):
        path = model_for(args.dir, wtype)
        size = path.stat().st_size
        for t in threads:
            pre: dict[str, list[float]] = {p: [] for p in PLACEMENTS}
            dec: dict[str, list[float]] = {p: [] for p in PLACEMENTS}
            weights: dict[str, dict] = {}
            diff: dict[str, float] = {}
            for rnd in range(args.rounds):
                order = PLACEMENTS if rnd % 2 == 0 else PLACEMENTS[::-1]
                got: dict[str, np.ndarray] = {}
                for p in order:
                    out = args.dir / f"logits-{p}.npy"
                    a, b, weights[p] = one(path, p, t, args, out)
                    pre[p].append(a)
                    dec[p].append(b)
                    got[p] = np.load(out)
                for p in PLACEMENTS:
                    d = float(np.abs(got[p] - got["defaults"]).max())
                    diff[p] = max(diff.get(p, 0.0), d)
            base_p = statistics.median(pre["defaults"])
            base_d = statistics.median(dec["defaults"])
            for p in PLACEMENTS:
                mp, md = statistics.median(pre[p]), statistics.median(dec[p])
                w = weights[p]
                anon = (w["anon_bytes_of_load"] or 0) / 1e6
                cells.setdefault((wtype, t), {})[p] = {
                    "prefill": mp / base_p,
                    "decode": md / base_d,
                    "tok/s": md,
                    "anon": anon,
                }
                print(
                    f"{wtype:7} {t:>3} {p:15} {mp:>11.1f} {mp / base_p:>5.2f} {md:>10.1f} "
                    f"{md / base_d:>5.2f} {anon:>8.1f} {diff[p]:>12.4f}  "
                    f"{len(w['repacked'])} ({len(w['repacked_experts'])} expert)"
                )
            sys.stdout.flush()
        print(f"load average {os.getloadavg()[0]:.2f}")
        print(
            f"{wtype}: {size / 1e6:.0f} MB file, {args.rounds} rounds, {args.seen_prompt_tokens}-token "
            f"prompt, {args.tokens} decode tokens, all cached"
        )
    record_headline(cells)


def record_headline(cells: dict[tuple[str, int], dict[str, dict[str, float]]]) -> None:
    """``experts-mapped`` against ``defaults``, the first type at the first thread count, as
    benchmarks/README.md's table shows it."""
    (wtype, t), first = next(iter(cells.items()))
    mapped, defaults = first["experts-mapped"], first["defaults"]
    others = {f"{k[0]} t{k[1]} decode": v["experts-mapped"]["decode"] for k, v in cells.items()}
    record(
        "placement",
        title="Q4 experts left in the mapping",
        what=f"cached decode tok/s with the experts in the file's mapping (`experts-mapped`), "
        f"{wtype}, {t} thread{'s' if t > 1 else ''}",
        ratio=mapped["decode"],
        yardstick="llama.cpp's defaults, everything repacked",
        yardstick_value=defaults["tok/s"],
        unit="tok/s",
        figures={
            "experts-mapped tok/s": mapped["tok/s"],
            "prefill": mapped["prefill"],
            "anonymous MB, experts-mapped": mapped["anon"],
            "anonymous MB, defaults": defaults["anon"],
        }
        | others,
        detail=f"anonymous memory {mapped['anon']:.1f} MB against {defaults['anon']:.1f} MB; "
        f"prefill {mapped['prefill']:.2f}×",
        model=f"planted qwen3moe, 8 layers × 32 experts, top-8, hidden 1024, {wtype}, fully cached",
    )


if __name__ == "__main__":
    main()
