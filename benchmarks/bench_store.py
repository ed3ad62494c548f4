"""Expert-store build and verify against plain yardsticks measured in the same run.

For each size (default 0.5 and 2: GiB of expert bytes in a synthetic qwen3moe, F32, small
vocabulary, so the file is almost all experts; the table prints the real sizes):
  * store build time / copying the same expert bytes with a plain streaming copy (read + write
    + fsync, 16 MiB chunks, in file order), and / coreutils ``cp`` + fsync of the whole model;
  * store verify time / reading the store and the model's expert bytes once each;
  * peak RSS (VmHWM) of build and of verify, each in a fresh child process: it must not grow
    with the model's size.
Every timed step starts cold (the files' pages dropped after a sync, confirmed by cachestat).
Rounds pair each yardstick with the step it judges; ratios are medians of per-round ratios.

    .venv/bin/python benchmarks/bench_store.py [--sizes 0.5,2] [--dir DIR] [--rounds 3] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

from bench_repack import child, cp_copy, drop_cache, spec_for  # the same cold-start helpers
from headline import record
from moepack.checkpoint import MoeModel
from moepack.checkpoint.synth import SynthSpec, synth_model

CHUNK = 16 * 1024 * 1024


def store_spec(gib: float) -> SynthSpec:
    """A model that is almost all experts (a 512-token vocabulary)."""
    return spec_for(gib, vocab=512)


def expert_ranges(model: Path) -> list[tuple[int, int]]:
    """(offset, length) of every expert matrix tensor, in file order."""
    with MoeModel(model) as m:
        ranges = [(t.entry.offset, t.entry.n_bytes) for b in m.blocks for t in b.weight_tensors]
    return sorted(ranges)


def copy_expert_bytes(model: Path, ranges: list[tuple[int, int]], dst: Path) -> float:
    """The yardstick: the expert bytes read in 16 MiB chunks and written out, then fsync."""
    t = time.perf_counter()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(model, "rb", buffering=0) as fi, open(dst, "wb", buffering=0) as fo:
        for off, n in ranges:
            fi.seek(off)
            left = n
            while left:
                got = fi.readinto(view[: min(CHUNK, left)])
                if not got:
                    raise SystemExit(f"{model} ended early")
                fo.write(view[:got])
                left -= got
        os.fsync(fo.fileno())
    return time.perf_counter() - t


def read_store_and_experts(store: Path, model: Path, ranges: list[tuple[int, int]]) -> float:
    """The verify yardstick: the store read once, and the model's expert bytes read once."""
    t = time.perf_counter()
    buf = bytearray(CHUNK)
    with open(store, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    view = memoryview(buf)
    with open(model, "rb", buffering=0) as f:
        for off, n in ranges:
            f.seek(off)
            left = n
            while left:
                got = f.readinto(view[: min(CHUNK, left)])
                left -= got
                if not got:
                    break
    return time.perf_counter() - t


def bench(gib: float, folder: Path, keep: bool, rounds: int) -> dict[str, float]:
    model = folder / f"store-bench-{gib:g}g.gguf"
    if not model.exists():
        print(f"generating {model} ...", flush=True)
        synth_model(model, store_spec(gib))
    ranges = expert_ranges(model)
    file_bytes = model.stat().st_size
    expert_bytes = sum(n for _, n in ranges)
    store = folder / f"store-bench-{gib:g}g.moestore"
    copy = folder / f"store-bench-{gib:g}g.copy"
    copy_s, cp_s, build_s, read_s, verify_s = [], [], [], [], []
    rss_build = rss_verify = 0.0
    for _ in range(rounds):
        drop_cache(model)
        copy_s.append(copy_expert_bytes(model, ranges, copy))
        copy.unlink()
        drop_cache(model)
        cp_s.append(cp_copy(model, copy))
        copy.unlink()
        store.unlink(missing_ok=True)
        drop_cache(model)
        t, _, rss = child(
            "from moepack.store.build import build_store",
            f"build_store({str(model)!r}, {str(store)!r})",
        )
        build_s.append(t)
        rss_build = max(rss_build, rss)
        drop_cache(model, store)
        read_s.append(read_store_and_experts(store, model, ranges))
        drop_cache(model, store)
        t, _, rss = child(
            "from moepack.store.verify import verify_store",
            f"assert verify_store({str(store)!r}, {str(model)!r}).ok",
        )
        verify_s.append(t)
        rss_verify = max(rss_verify, rss)
    store_bytes = store.stat().st_size
    if not keep:
        store.unlink()
        model.unlink()

    def paired(a: list[float], b: list[float]) -> float:
        return statistics.median(x / y for x, y in zip(a, b, strict=True))

    return {
        "expert_gib": expert_bytes / 2**30,
        "file_gib": file_bytes / 2**30,
        "store_gib": store_bytes / 2**30,
        "copy_s": statistics.median(copy_s),
        "cp_s": statistics.median(cp_s),
        "build_s": statistics.median(build_s),
        "build_ratio": paired(build_s, copy_s),
        "build_ratio_cp": paired(build_s, cp_s),
        "read_s": statistics.median(read_s),
        "verify_s": statistics.median(verify_s),
        "verify_ratio": paired(verify_s, read_s),
        "rss_build_mb": rss_build,
        "rss_verify_mb": rss_verify,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="0.5,2", help="GiB of expert bytes per model")
    ap.add_argument("--dir", type=Path, default=Path("bench-data"))
    ap.add_argument("--keep", action="store_true", help="keep the generated models")
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds per size")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    sizes = [float(s) for s in args.sizes.split(",")]
    need = max(sizes) * 3.2 * 2**30
    if shutil.disk_usage(args.dir).free < need:
        raise SystemExit(f"need {need / 2**30:.0f} GiB free in {args.dir}")
    rows = [bench(g, args.dir, args.keep, args.rounds) for g in sizes]
    print()
    print(
        f"{'file':>7} {'experts':>8} {'store':>7} {'copy s':>7} {'cp s':>6} {'build s':>8} "
        f"{'ratio':>6} {'vs cp':>6} {'read s':>7} {'verify s':>9} {'ratio':>6} {'RSS build':>10} "
        f"{'RSS verify':>11}"
    )
    for r in rows:
        print(
            f"{r['file_gib']:6.2f}G {r['expert_gib']:7.2f}G {r['store_gib']:6.2f}G "
            f"{r['copy_s']:7.2f} {r['cp_s']:6.2f} "
            f"{r['build_s']:8.2f} {r['build_ratio']:6.2f} {r['build_ratio_cp']:6.2f} "
            f"{r['read_s']:7.2f} {r['verify_s']:9.2f} {r['verify_ratio']:6.2f} "
            f"{r['rss_build_mb']:8.0f}MB {r['rss_verify_mb']:9.0f}MB"
        )
    print(
        "times are medians; ratios are medians of per-round ratios, every step cold.\n"
        "build 'ratio': against copying the expert bytes (read + write + fsync, 16 MiB chunks);\n"
        "'vs cp': against coreutils cp + fsync of the whole model file. verify 'ratio': against\n"
        "reading the store and the model's expert bytes once each. Build and verify run in fresh\n"
        "child processes (their time includes starting Python and importing moepack)."
    )
    r = max(rows, key=lambda r: r["file_gib"])
    record(
        "store",
        title="Expert store build, cold",
        what="building the expert-major store, time",
        ratio=r["build_ratio"],
        yardstick="a streaming copy (read + write + fsync) of the same expert bytes",
        yardstick_value=r["copy_s"],
        unit="s",
        figures={
            "build s": r["build_s"],
            "copy s": r["copy_s"],
            "build / cp + fsync": r["build_ratio_cp"],
            "verify / read both": r["verify_ratio"],
            "peak RSS build MB": r["rss_build_mb"],
            "peak RSS verify MB": r["rss_verify_mb"],
            "rounds": args.rounds,
        },
        detail=f"verify {r['verify_ratio']:.2f}× reading both; peak RSS "
        f"{max(x['rss_build_mb'] for x in rows):.0f} MB",
        model=f"synthetic qwen3moe, F32, 32 experts of 1024 × 1024, {r['file_gib'] * 2**30 / 1e9:.2f} GB "
        f"({r['expert_gib'] * 2**30 / 1e9:.2f} GB of experts)",
    )


if __name__ == "__main__":
    main()
