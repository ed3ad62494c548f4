"""Routing traces against numpy yardsticks measured in the same run.

For a synthetic trace (default 100k tokens x 48 layers x top-8 of 128 experts, Qwen3-30B-like):
  * synthesis / drawing the same number of uniform ids with numpy (the price of the planted
    structure: clusters, persistence, coupling, distinct experts per row);
  * reading each format (validation and checksum included) / ``np.fromfile`` of the same file;
  * writing each format (atomic: temp file, fsync, rename) / ``ndarray.tofile`` + fsync of the
    same number of bytes;
  * ``summarize`` (everything ``trace info`` shows) / one ``np.fromfile`` of the native file.
Reads are warm (the file was just written, for the yardstick too); each time is the best of
``--repeat`` runs.

    .venv/bin/python benchmarks/bench_trace.py [--tokens 100000] [--layers 48] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from headline import record
from moepack.trace import load_trace, save_trace, summarize, synth_trace

FORMATS = [("moetrace", ".moetrace", None), ("pmxtrace", ".pmxtrace", 2), ("text", ".txt", None)]


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def tofile_fsync(data: np.ndarray, dest: Path) -> None:
    with open(dest, "wb") as fh:
        data.tofile(fh)
        fh.flush()
        os.fsync(fh.fileno())


def record_headline(timed: dict[str, tuple[float, float]], shape: tuple, experts: int) -> None:
    """Reading the peer's ``.pmxtrace``, as benchmarks/README.md's table shows it."""
    read, fromfile = timed["read pmxtrace"]
    write, tofile = timed["write pmxtrace"]
    native = timed["read moetrace"][0]
    record(
        "trace-formats",
        title="Trace formats: read and write",
        what="reading a `.pmxtrace` (validated), time",
        ratio=read / fromfile,
        yardstick="`np.fromfile` of the same file",
        yardstick_value=fromfile,
        unit="s",
        figures={f"{k} s": t for k, (t, _) in timed.items()}
        | {f"{k} / yardstick": t / y for k, (t, y) in timed.items()},
        detail=f"written in {write / tofile:.2f}× `tofile` + fsync; `.moetrace` read in "
        f"{native:.2f} s",
        model=f"{shape[0]:,} tokens × {shape[1]} layers × top-{shape[2]} of {experts} experts",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-trace-", dir=args.dir))
    shape = (args.tokens, args.layers, args.top_k)
    print(f"trace {shape[0]:,} tokens x {shape[1]} layers x top-{shape[2]} of {args.experts}")
    try:
        t_synth = best(
            lambda: synth_trace(
                tokens=args.tokens,
                layers=args.layers,
                n_expert=args.experts,
                top_k=args.top_k,
                prefill_tokens=min(1000, args.tokens // 10),
                seed=1,
            ),
            1,
        )
        rng = np.random.default_rng(0)
        t_uniform = best(lambda: rng.integers(0, args.experts, size=shape, dtype=np.uint8), 3)
        trace = synth_trace(
            tokens=args.tokens,
            layers=args.layers,
            n_expert=args.experts,
            top_k=args.top_k,
            prefill_tokens=min(1000, args.tokens // 10),
            seed=1,
        )
        print(f"{'step':<30}{'seconds':>10}{'yardstick':>12}{'ratio':>9}")

        timed: dict[str, tuple[float, float]] = {}

        def row(name: str, t: float, y: float) -> None:
            timed[name.split(" (")[0]] = (t, y)
            print(f"{name:<30}{t:>10.3f}{y:>12.3f}{t / y:>8.2f}x")

        row("synth vs uniform draws", t_synth, t_uniform)
        for fmt, ext, version in FORMATS:
            dest = folder / f"t{ext}"

            def write(fmt: str = fmt, dest: Path = dest, version: int | None = version) -> None:
                if dest.exists():
                    dest.unlink()
                save_trace(trace, dest, format=fmt, version=version)

            t_write = best(write, args.repeat)
            size = dest.stat().st_size
            blob = np.zeros(size, dtype=np.uint8)
            t_tofile = best(partial(tofile_fsync, blob, folder / "plain.bin"), 3)
            t_read = best(partial(load_trace, dest), args.repeat)
            t_fromfile = best(partial(np.fromfile, dest, dtype=np.uint8), args.repeat)
            mb = size / 1e6
            row(f"write {fmt} ({mb:,.0f} MB)", t_write, t_tofile)
            row(f"read {fmt}", t_read, t_fromfile)
        native = load_trace(folder / "t.moetrace")
        t_sum = best(lambda: summarize(native), 1)
        t_ff = best(lambda: np.fromfile(folder / "t.moetrace", dtype=np.uint8), args.repeat)
        row("summarize (trace info)", t_sum, t_ff)
        record_headline(timed, shape, args.experts)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
