"""Decode tokens/s of llama.cpp with routing capture against the same decode without it.

A mid-size synthetic qwen3moe (default 8 layers, 64 experts, top-8, hidden 1024, expert FFN
256, Q8_0) is decoded greedily by two llama.cpp contexts side by side, in this process:
  * yardstick: a plain context (no eval callback);
  * capture: the context ``trace capture`` uses — the eval callback with deferred reads of
    every MoE layer's ``ffn_moe_topk`` and final router weights, spooled to disk after every
    token exactly as the capture worker does.
The two alternate token by token (which goes first alternates too), so a burst of load from
other processes on a shared machine hits both alike; each decode step is timed, and the
ratio is median plain step time / median capture step time (= capture tok/s / plain tok/s).
Target: capture >= 0.95 x plain.

    .venv/bin/python benchmarks/bench_capture.py [--tokens 400] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from headline import record
from moepack.checkpoint.synth import SynthSpec, synth_model
from moepack.llama.runtime.capture_worker import RoutingSpool
from moepack.llama.runtime.session import LlamaSession, SessionParams
from moepack.trace.core import id_dtype_for

PROMPT = [1, 300, 301, 302, 303, 304, 305, 306]


class Decoder:
    """One context decoding greedily; ``step`` feeds one token and returns its seconds."""

    def __init__(self, model: Path, params: SessionParams, spool: RoutingSpool | None) -> None:
        self.spool = spool
        self.session = LlamaSession(str(model), params, spool.callback if spool else None)
        self.logits = self.session.decode(PROMPT, 0, all_logits=True)
        if spool is not None:
            spool.flush(PROMPT)
        self.pos = len(PROMPT)

    def step(self) -> float:
        tok = int(np.argmax(self.logits))
        t0 = time.perf_counter()
        self.logits = self.session.decode([tok], self.pos, all_logits=True)
        if self.spool is not None:
            self.spool.flush([tok])
        dt = time.perf_counter() - t0
        self.pos += 1
        return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=400)
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
        params = SessionParams(
            n_ctx=len(PROMPT) + args.tokens + 8, n_batch=64, n_ubatch=64, threads=args.threads
        )
        with ExitStack() as files:
            blocks, dtype = list(range(spec.layers)), id_dtype_for(spec.experts).name
            spool = RoutingSpool(files, folder, blocks, spec.top_k, dtype, max_tokens=64)
            plain, capture = Decoder(model, params, None), Decoder(model, params, spool)
            tp: list[float] = []
            tc: list[float] = []
            for i in range(args.tokens):
                if i % 2:
                    tp.append(plain.step())
                    tc.append(capture.step())
                else:
                    tc.append(capture.step())
                    tp.append(plain.step())
            plain.session.close()
            capture.session.close()
        mp, mc = statistics.median(tp), statistics.median(tc)
        print(f"decode steps: {args.tokens} per context, {args.threads} thread(s)")
        print(f"plain   median {1 / mp:7.1f} tok/s   mean {len(tp) / sum(tp):7.1f} tok/s")
        print(f"capture median {1 / mc:7.1f} tok/s   mean {len(tc) / sum(tc):7.1f} tok/s")
        print(f"ratio capture/plain: {mp / mc:.3f} (median), {sum(tp) / sum(tc):.3f} (mean)")
        print("target: >= 0.95")
        record(
            "capture",
            title="Routing capture overhead",
            what="decode tok/s with `trace capture`'s eval callback (median step)",
            ratio=mp / mc,
            yardstick="the same decode without it, alternated token by token",
            yardstick_value=1 / mp,
            unit="tok/s",
            figures={
                "capture tok/s": 1 / mc,
                "plain tok/s": 1 / mp,
                "ratio of means": sum(tp) / sum(tc),
                "steps": args.tokens,
                "threads": args.threads,
            },
            target="≥ 0.95 (issue 9)",
            met=mp / mc >= 0.95,
            detail=f"{args.threads} thread(s), {args.tokens} steps each",
            model=f"synthetic qwen3moe, {shape}, hidden {spec.hidden}, {spec.weight_type}, "
            f"{size / 2**20:.0f} MiB",
        )


if __name__ == "__main__":
    main()
