"""``moepack replay`` against yardsticks measured in the same run.

A synthetic qwen3moe model (default 8 MoE blocks x 64 experts, top-8, F32 slices of 512 KiB,
768 MiB) with a planted-cluster trace, its expert-major store, and an LRU cache:

  * replay's achieved bandwidth / the probe surface's cell at the same request size and
    queue depth (``run_probe`` on the same file, same engine, O_DIRECT), for the store (one
    request per expert) and the GGUF (one per slice); target >= 0.9;
  * store vs GGUF replay of the same trace and cache: bytes per token (equal), requests per
    token (a third), and the measured time ratio;
  * the share of the store replay's read time that copying its bytes into the cache takes
    (the same copies timed alone);
  * peak RSS of a ``moepack replay`` process minus its cache, for this model and one four
    times smaller at the same byte budget: bounded by the budget plus a constant.

Interleaved rounds (probe, GGUF, store), medians reported.

    .venv/bin/python benchmarks/bench_replay.py --dir /tmp/bench-replay [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import subprocess
import sys
import time
from pathlib import Path

from headline import record
from moepack.checkpoint.model import MoeModel
from moepack.checkpoint.synth import SynthSpec, synth_model
from moepack.storage.modes import Mode
from moepack.storage.probe import run_probe
from moepack.store.build import build_store
from moepack.stream.budget import CacheBudget
from moepack.stream.command import replay_command
from moepack.stream.replay import ReplayOptions
from moepack.trace import save_trace, synth_trace


def model_and_store(folder: Path, layers: int, experts: int, top_k: int, ffn: int) -> Path:
    path = folder / f"replay-{layers}x{experts}-{ffn}.gguf"
    if not path.exists():
        spec = SynthSpec(layers=layers, experts=experts, top_k=top_k, hidden=512, expert_ffn=ffn)
        synth_model(path, spec)
    store = path.with_suffix(".moestore")
    if not store.exists():
        build_store(path, store)
    trace = path.with_suffix(".moetrace")
    if not trace.exists():
        with MoeModel(path) as m:
            save_trace(synth_trace(m, tokens=4000, seed=1), trace)
    return path


def peak_rss(source: Path, trace: Path, cache: str, tokens: str) -> dict[str, int]:
    """One ``moepack replay`` in its own process: its peak RSS and its cache's bytes."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "moepack",
            "replay",
            str(source),
            str(trace),
            "--cache",
            cache,
            "--tokens",
            tokens,
            "--json",
            "-q",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    d = json.loads(out)
    return {"rss": d["peak_rss"], "cache": d["cache_bytes"] + d["readahead_bytes"]}


def copy_seconds(size: int, count: int) -> float:
    """How long ``count`` copies of ``size`` bytes into a faulted-in buffer take (the copy
    replay makes of every read into its cache slot)."""
    src = mmap.mmap(-1, size)
    dst = mmap.mmap(-1, 16 * size)
    dst.write(bytes(16 * size))
    a, b = memoryview(src), memoryview(dst)
    t0 = time.perf_counter()
    for i in range(count):
        off = (i % 16) * size
        b[off : off + size] = a
    dt = time.perf_counter() - t0
    a.release()
    b.release()
    src.close()
    dst.close()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/bench-replay"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--tokens", default="0:400", help="Replayed token range.")
    ap.add_argument("--engine", default="threads")
    ap.add_argument("--qd", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cell-seconds", type=float, default=1.0)
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    path = model_and_store(args.dir, args.layers, args.experts, args.top_k, args.ffn)
    store, trace = path.with_suffix(".moestore"), path.with_suffix(".moetrace")
    opts = ReplayOptions(CacheBudget(slots=args.slots), "lru", args.engine, args.qd, Mode.DIRECT)
    with MoeModel(path) as m:
        slice_bytes = m.blocks[0].weight_tensors[0].slice_bytes
    ratios: dict[str, list[float]] = {"store": [], "gguf": []}
    gbps: dict[str, list[float]] = {"store": [], "gguf": [], "probe store": [], "probe gguf": []}
    last = {}
    sizes = {"store": 3 * slice_bytes, "gguf": slice_bytes}
    for r in range(args.rounds):
        # each replay right after its probe cell, so the ratio is taken within seconds
        for name, source in (("gguf", path), ("store", store))[:: 1 if r % 2 == 0 else -1]:
            size = sizes[name]
            cell = run_probe(
                source,
                engine=args.engine,
                mode=Mode.DIRECT,
                sizes=[size],
                depths=[args.qd],
                cell_seconds=args.cell_seconds,
                repeats=1,
            ).surface.bandwidth(size, args.qd)
            res = replay_command(source, trace, opts, token_range=args.tokens).replay
            ratios[name].append(res.gbps * 1e9 / cell)
            gbps[name].append(res.gbps)
            gbps[f"probe {name}"].append(cell / 1e9)
            last[name] = res
    med = statistics.median
    g, s = last["gguf"], last["store"]
    print(
        f"model {path.name} ({path.stat().st_size / 2**20:.0f} MiB): {args.layers} MoE blocks x "
        f"{args.experts} experts, top-{args.top_k}, slice {slice_bytes // 1024} KiB; LRU "
        f"{args.slots} slots/layer, tokens {args.tokens}, {args.engine} qd{args.qd} O_DIRECT; "
        f"medians of {args.rounds} rounds, each replay right after a probe cell on its file"
    )
    print(f"hit rate {100 * g.rates.lifetime:.2f} % (store {100 * s.rates.lifetime:.2f} %)")
    for name in ("store", "gguf"):
        print(
            f"{name:>5}: replay {med(gbps[name]):6.3f} GB/s  probe cell ({sizes[name] // 1024} KiB,"
            f" qd{args.qd}) {med(gbps['probe ' + name]):6.3f} GB/s  ratio per round "
            f"{', '.join(f'{x:.2f}' for x in ratios[name])}  median {med(ratios[name]):.3f} "
            "(target >= 0.9)"
        )
    print(
        f"bytes/token store / gguf {s.bytes_per_token / g.bytes_per_token:.4f}; requests/token "
        f"{s.requests_per_token:.2f} / {g.requests_per_token:.2f} = "
        f"{s.requests_per_token / g.requests_per_token:.4f}; I/O time/token "
        f"{s.io_seconds_per_token * 1e6:.0f} / {g.io_seconds_per_token * 1e6:.0f} us = "
        f"{s.seconds / g.seconds:.3f}"
    )
    record(
        "replay",
        title="Expert streaming replay",
        what=f"`replay` bandwidth from the expert store (LRU, {args.engine} QD {args.qd}, O_DIRECT)",
        ratio=med(ratios["store"]),
        yardstick="a probe cell of the same file at the replay's request size",
        yardstick_value=med(gbps["probe store"]),
        unit="GB/s",
        figures={
            "store replay GB/s": med(gbps["store"]),
            "store probe cell GB/s": med(gbps["probe store"]),
            "GGUF replay / probe": med(ratios["gguf"]),
            "requests/token store / GGUF": s.requests_per_token / g.requests_per_token,
            "rounds": args.rounds,
        },
        target="≥ 0.9 × the probe cell (issue 13)",
        met=med(ratios["store"]) >= 0.9,
        detail=f"GGUF {med(ratios['gguf']):.3f}; per round "
        + ", ".join(f"{x:.2f}" for x in ratios["store"]),
        model=f"synthetic qwen3moe, {args.layers} MoE blocks × {args.experts} experts, "
        f"top-{args.top_k}, {slice_bytes // 1024} KiB F32 slices "
        f"({path.stat().st_size / 2**20:.0f} MiB), and its expert store",
    )
    chunk = 3 * slice_bytes
    copied = copy_seconds(chunk, s.requests)
    print(
        f"copying the store replay's {s.requests} records into the cache alone: {copied:.2f} s "
        f"= {100 * copied / s.seconds:.1f} % of its read time (the copy runs inside the "
        "engine's completion lock)"
    )
    small = model_and_store(args.dir, args.layers, args.experts, args.top_k, args.ffn // 4)
    budget = str(args.top_k * args.layers * 3 * slice_bytes)  # top-k slots of the larger model
    for p in (small, path):
        got = peak_rss(p.with_suffix(".moestore"), p.with_suffix(".moetrace"), budget, args.tokens)
        print(
            f"peak RSS {p.name} ({p.stat().st_size / 2**20:.0f} MiB): {got['rss'] / 2**20:.0f} "
            f"MiB = cache {got['cache'] / 2**20:.0f} MiB + {(got['rss'] - got['cache']) / 2**20:.0f} "
            "MiB"
        )


if __name__ == "__main__":
    main()
