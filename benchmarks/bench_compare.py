"""``compare`` benchmark: throughput against gguf-py's whole-tensor ``dequantize``, and memory.

    .venv/bin/python benchmarks/bench_compare.py                 # 1 block, 32 experts of 512x512
    .venv/bin/python benchmarks/bench_compare.py --experts 64 --repeat 5

A synthetic F32 qwen3moe model is quantised by llama.cpp (Q4_K_M by default: Q4_K gate/up,
Q6_K down). Each measurement runs in its own child process, in rotating order, on the expert
tensors (``*_exps.weight``) of both files, which are in the page cache (warmed once, untimed):

  yardstick  gguf-py's ``quants.dequantize`` of each whole tensor of both files, nothing else;
  gguf       ``moepack.quant.compare`` with gguf-py's codecs: chunked reads, dequantise, all
             metrics, per expert;
  ggml       the same with ggml's C dequantisers (libggml-base from llama-cpp-python).

Printed: median seconds, dequantised MB/s, the ratio yardstick time / compare time (target
>= 1.0 for gguf, >= 2.0 for ggml), and each child's peak RSS above its RSS after imports,
against the largest tensor's float32 size and the chunk's (per thread, per side).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from headline import record
from moepack.checkpoint.llama_quantize import llama_quantize
from moepack.checkpoint.synth import SynthSpec, synth_model
from moepack.quant.compare import CHUNK_VALUES

CHILD = r"""
import json, resource, sys, time
import numpy as np
from gguf import GGUFReader, quants
from moepack.quant.compare import compare
ref, cand, what = sys.argv[1], sys.argv[2], sys.argv[3]
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
base = hwm()
t0 = time.perf_counter()
values = 0
if what == "yardstick":
    for path in (ref, cand):
        for t in GGUFReader(path).tensors:
            if t.name.endswith("_exps.weight"):
                values += quants.dequantize(np.asarray(t.data), t.tensor_type).size
else:
    r = compare(ref, cand, tensor_pattern="*_exps.weight", per_expert=True, engine=what)
    values = 2 * sum(t.metrics.values for t in r.tensors)
print(json.dumps({"seconds": time.perf_counter() - t0, "values": values,
                  "rss_above_base": hwm() - base}))
"""


def run_child(ref: Path, cand: Path, what: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(ref), str(cand), what],
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, float] = json.loads(out.stdout)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--width", type=int, default=512, help="hidden = expert ffn width")
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        spec = SynthSpec(
            layers=1, experts=args.experts, top_k=4, hidden=args.width, expert_ffn=args.width
        )
        ref = synth_model(folder / "f32.gguf", spec).paths[0]
        cand = folder / "q.gguf"
        llama_quantize(ref, cand, args.type)
        for p in (ref, cand):
            p.read_bytes()  # warm the page cache
        runs: dict[str, list[dict[str, float]]] = {"yardstick": [], "gguf": [], "ggml": []}
        names = list(runs)
        for i in range(args.repeat):
            for what in names[i % 3 :] + names[: i % 3]:
                runs[what].append(run_child(ref, cand, what))
        largest = 4 * args.width * args.width * args.experts
        print(
            f"model: 1 block, {args.experts} experts of {args.width}x{args.width}, F32 vs "
            f"{args.type}; {ref.stat().st_size / 1e6:.0f} + {cand.stat().st_size / 1e6:.0f} MB"
        )
        print(
            f"largest tensor as float32: {largest / 2**20:.0f} MiB; "
            f"chunk: {4 * CHUNK_VALUES / 2**20:.0f} MiB per side and thread"
        )
        base = statistics.median(r["seconds"] for r in runs["yardstick"])
        print(f"{'':10} {'median s':>9} {'MB/s':>8} {'ratio':>6} {'peak RSS MiB':>13}")
        sec: dict[str, float] = {}
        for what in names:
            s = sec[what] = statistics.median(r["seconds"] for r in runs[what])
            mbs = runs[what][0]["values"] * 4 / s / 1e6
            rss = max(r["rss_above_base"] for r in runs[what]) / 2**20
            print(f"{what:10} {s:9.3f} {mbs:8.0f} {base / s:6.2f} {rss:13.0f}")
        ggml, gguf = base / sec["ggml"], base / sec["gguf"]
        record(
            "compare",
            title="`compare` (quantisation metrics)",
            what="`compare(..., per_expert=True)` with ggml's dequantisers, speed",
            ratio=ggml,
            yardstick="gguf-py's `dequantize` of each whole tensor alone",
            yardstick_value=base,
            unit="s",
            figures={f"{k} s": v for k, v in sec.items()}
            | {"gguf-py codecs": gguf, "repeats": args.repeat},
            target="≥ 2× with ggml, ≥ 1× with gguf-py (issue 14)",
            met=ggml >= 2 and gguf >= 1,
            target_value=f"{ggml:.2f}× and {gguf:.2f}×",
            detail=f"with gguf-py's codecs {gguf:.2f}×",
            model=f"synthetic F32, 1 block, {args.experts} experts of {args.width} × {args.width}, "
            f"against its {args.type} quantisation by llama.cpp",
        )


if __name__ == "__main__":
    main()
