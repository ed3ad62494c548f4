"""Decode tokens/s of llama.cpp with routing capture against the same decode without it.

A mid-size synthetic qwen3moe (default 8 layers, 64 experts, top-8, hidden 1024, expert FFN
256, Q8_0) is decoded greedily in one llama.cpp context per run, in this process:
  * yardstick: a plain context (no eval callback);
  * capture: the context ``trace capture`` uses — the eval callback with deferred reads of
    every MoE layer's ``ffn_moe_topk`` and final router weights, spooled to disk after every
    token exactly as the capture worker does.
Runs alternate (plain, capture, plain, …) so drift on a shared machine hits both; each run
times ``--tokens`` decode steps after a short prefill, and the ratio is the median of the
pair ratios. Target: capture ≥ 0.95 × plain.

    .venv/bin/python benchmarks/bench_capture.py [--pairs 9] [--tokens 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from moepack.checkpoint.synth import SynthSpec, synth_model
from moepack.llama.capture_worker import RoutingSpool
from moepack.llama.session import LlamaSession, SessionParams
from moepack.trace.core import id_dtype_for

PROMPT = [1, 300, 301, 302, 303, 304, 305, 306]


def decode_rate(model: Path, threads: int, tokens: int, spool_dir: Path | None) -> float:
    """Tokens/s of ``tokens`` greedy decode steps (the prefill is not timed)."""
    params = SessionParams(n_ctx=len(PROMPT) + tokens + 8, n_batch=64, n_ubatch=64, threads=threads)
    with ExitStack() as files:
        spool = None
        if spool_dir is not None:
            spool = RoutingSpool(files, spool_dir, list(range(8)), 8, id_dtype_for(64).name)
        s = LlamaSession(str(model), params, spool.callback if spool else None)
        logits = s.decode(PROMPT, 0, all_logits=True)
        if spool is not None:
            spool.flush(PROMPT)
        pos = len(PROMPT)
        t0 = time.perf_counter()
        for _ in range(tokens):
            tok = int(np.argmax(logits))
            logits = s.decode([tok], pos, all_logits=True)
            if spool is not None:
                spool.flush([tok])
            pos += 1
        dt = time.perf_counter() - t0
        s.close()
    return tokens / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: temp)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-capture-", dir=args.dir) as d:
        folder = Path(d)
        spec = SynthSpec(
            layers=8,
            experts=64,
            top_k=8,
            hidden=1024,
            expert_ffn=256,
            heads=8,
            kv_heads=4,
            head_dim=128,
            vocab=512,
            weight_type="Q8_0",
        )
        t = time.perf_counter()
        model = synth_model(folder / "mid.gguf", spec).paths[0]
        size = model.stat().st_size
        shape = f"{spec.layers} layers x {spec.experts} experts, top-{spec.top_k}"
        took = time.perf_counter() - t
        print(f"model: {shape}, hidden {spec.hidden}, {spec.weight_type}, {size / 2**20:.0f} MiB")
        print(f"(synthesised in {took:.0f} s)")
        decode_rate(model, args.threads, 8, None)  # warm the page cache and the code paths
        plain, captured, ratios = [], [], []
        for i in range(args.pairs):
            spool = folder / f"spool{i}"
            spool.mkdir()
            a = decode_rate(model, args.threads, args.tokens, None)
            b = decode_rate(model, args.threads, args.tokens, spool)
            plain.append(a)
            captured.append(b)
            ratios.append(b / a)
            print(
                f"pair {i + 1}: plain {a:7.1f} tok/s   capture {b:7.1f} tok/s   ratio {b / a:.3f}"
            )
        print(
            f"median: plain {statistics.median(plain):.1f} tok/s, capture "
            f"{statistics.median(captured):.1f} tok/s, ratio {statistics.median(ratios):.3f} "
            f"(target >= 0.95; {args.threads} threads, {args.tokens} decode tokens per run)"
        )


if __name__ == "__main__":
    main()
