"""What ``compare``'s router verdict must tell apart: honest quantisation of a router tensor
(``ffn_gate_inp``, one row of ``n_embd`` weights per expert) against two of its rows swapped.

For every type a moepack quantiser writes without an importance matrix (gguf-py's, then
ggml's ``ggml_quantize_chunk``), a Gaussian router of ``n_expert`` rows is quantised and
dequantised with compare's own engine and metrics; the tensor's relative error and
correlation, and the worst row's relative error, are printed. Then the same for the F32 router
with two rows swapped, for several expert counts. No timing: no lock needed.

    .venv/bin/python benchmarks/bench_router_verdict.py [--n-embd 2048] [--seeds 3]
"""

from __future__ import annotations

import argparse

import numpy as np
from gguf.constants import GGMLQuantizationType

from moepack.quant.engine import DEQUANT_ENGINES, engine_for
from moepack.quant.metrics import DiffStats, Metrics
from moepack.quant.quantiser import QUANTISERS


def measure(ref: np.ndarray, cand: np.ndarray) -> tuple[Metrics, float]:
    """The whole tensor's metrics and the largest relative error of one row."""
    whole = DiffStats()
    worst = 0.0
    for a, b in zip(ref, cand, strict=True):
        row = DiffStats()
        row.add(a, b)
        whole.merge(row)
        worst = max(worst, row.metrics().rel_error or 0.0)
    return whole.metrics(), worst


SKIPPED = {"F32", "Q8_1", "Q8_K", "I8", "I16", "I32", "I64", "F64"}
"""No file stores a router in these: the reference itself, ggml's intermediate types (which
``ggml_quantize_chunk`` aborts on), integers."""


def roundtrip(w: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray | None:
    for q in QUANTISERS:
        if q.unavailable_reason() is None and q.supports(qtype):
            raw = q.quantize(w, qtype)
            engine = engine_for(qtype, DEQUANT_ENGINES.get("gguf"))
            if engine is None:
                return None
            return engine.dequantize(raw, qtype).reshape(w.shape)
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-embd", type=int, default=2048)
    ap.add_argument("--n-expert", type=int, default=128)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    print(
        f"router {args.n_expert} x {args.n_embd}, Gaussian rows, worst of {args.seeds} seeds\n"
        f"{'candidate':>22} {'rel. error':>11} {'corr':>9} {'worst row rel.':>15}"
    )
    rows = []
    for qtype in GGMLQuantizationType:
        if qtype.name in SKIPPED:
            continue
        rel, corr, worst, done = 0.0, 1.0, 0.0, False
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            w = (0.02 * rng.standard_normal((args.n_expert, args.n_embd))).astype(np.float32)
            back = roundtrip(w, qtype)
            if back is None:
                break
            m, row = measure(w, back)
            rel, corr = max(rel, m.rel_error or 0.0), min(corr, m.correlation or 0.0)
            worst, done = max(worst, row), True
        if done:
            rows.append((qtype.name, rel, corr, worst))
    for n in (8, 64, 128, 256, 512):
        rel, corr, worst = 0.0, 1.0, 0.0
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            w = (0.02 * rng.standard_normal((n, args.n_embd))).astype(np.float32)
            swapped = w.copy()
            swapped[[0, 1]] = w[[1, 0]]
            m, row = measure(w, swapped)
            rel, corr = max(rel, m.rel_error or 0.0), min(corr, m.correlation or 0.0)
            worst = max(worst, row)
        rows.append((f"F32, 2 of {n} swapped", rel, corr, worst))
    for name, rel, corr, worst in rows:
        print(f"{name:>22} {100 * rel:10.3f}% {corr:9.6f} {100 * worst:14.3f}%")


if __name__ == "__main__":
    main()
