"""moepack's read engines against fio, measured in the same run on the same file.

Random reads of 64 KiB and 1 MiB at queue depth 1, 8 and 32, O_DIRECT, one file. The device
here is a shared virtual disk whose speed flips between throttled and unthrottled states
within seconds, so the comparison is made in two phases per cell:

1. every engine of both tools runs once per round, interleaved (fio, moepack, fio, ...; the
   order flips every round); each tool's best engine is the one with the best median;
2. the two best engines then run as back-to-back pairs (order alternating), and the cell's
   ratio is the median of the per-pair ratios moepack / fio.

Also shown: the middle half of the pair ratios (25th..75th percentile), i.e. the noise.
Target: ratio >= 0.9 in every cell. Then, where Python's overhead shows: requests served
from the page cache (4 KiB, no device wait), per engine, in microseconds per request.

    .venv/bin/python benchmarks/bench_storage.py [--dir /var/tmp/moepack-bench]
        [--file-size 4G] [--seconds 0.5] [--rounds 3] [--pairs 15] [--json out.json]

fio is installed from Debian (apt-get) when it is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from moepack.storage import buffers
from moepack.storage.corpus import ensure_corpus
from moepack.storage.engine import get_engine
from moepack.storage.measure import RandomWork, measure_cell
from moepack.storage.modes import Mode, open_file
from moepack.storage.units import format_size, parse_size

SIZES = [64 << 10, 1 << 20]
DEPTHS = [1, 8, 32]


def ensure_fio() -> str:
    fio = shutil.which("fio")
    if fio:
        return fio
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        sys.exit("bench_storage: fio is missing and cannot be installed here (needs root + apt)")
    print("bench_storage: installing fio (apt-get) ...", file=sys.stderr)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=False, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "fio"], check=True, env=env)
    fio = shutil.which("fio")
    if not fio:
        sys.exit("bench_storage: fio did not install")
    return fio


def fio_engines(fio: str) -> list[str]:
    out = subprocess.run([fio, "--enghelp"], capture_output=True, text=True).stdout.split()
    return [e for e in ("io_uring", "libaio", "psync") if e in out]


def run_fio(fio: str, path: Path, engine: str, bs: int, qd: int, seconds: float) -> float:
    cmd = [
        fio, "--name=bench", f"--filename={path}", "--rw=randread", f"--bs={bs}",
        f"--iodepth={qd}", "--direct=1", f"--ioengine={engine}",
        f"--runtime={round(seconds * 1000)}ms",
        "--time_based", "--randrepeat=0", "--output-format=json",
    ]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"fio {engine} failed: {p.stderr.strip()[-300:]}")
    return json.loads(p.stdout[p.stdout.index("{") :])["jobs"][0]["read"]["bw_bytes"]


def interleave(a: list, b: list) -> list:
    out = []
    for i in range(max(len(a), len(b))):
        out += a[i : i + 1] + b[i : i + 1]
    return out


def compare(fio: str, path: Path, f_engines: list[str], args: argparse.Namespace) -> list[dict]:
    results = []
    with open_file(path, Mode.DIRECT) as f:

        def run(tool: str, eng: str, bs: int, qd: int, seed: int) -> float:
            if tool == "fio":
                return run_fio(fio, path, eng, bs, qd, args.seconds) / 1e9
            cell = measure_cell(f, get_engine(eng), bs, qd, args.seconds, seed)
            return cell.bytes_per_sec / 1e9

        for bs in SIZES:
            for qd in DEPTHS:
                m_eng = ["pread", "uring"] if qd == 1 else ["threads", "uring", "uring-batch"]
                f_eng = [e for e in f_engines if qd == 1 or e != "psync"]
                runs: dict[str, list[float]] = {}
                for rnd in range(args.rounds):
                    order = interleave([("fio", e) for e in f_eng], [("moepack", e) for e in m_eng])
                    for tool, eng in reversed(order) if rnd % 2 else order:
                        runs.setdefault(f"{tool}:{eng}", []).append(run(tool, eng, bs, qd, rnd))
                med = {k: statistics.median(v) for k, v in runs.items()}
                fio_best = max((k for k in med if k.startswith("fio:")), key=med.__getitem__)
                moe_best = max((k for k in med if k.startswith("moepack:")), key=med.__getitem__)
                pairs = []
                for i in range(args.pairs):
                    order = [fio_best, moe_best] if i % 2 == 0 else [moe_best, fio_best]
                    got = {k: run(*k.split(":"), bs, qd, 100 + i) for k in order}
                    pairs.append((got[fio_best], got[moe_best]))
                ratios = [m / fv for fv, m in pairs]
                q1, _, q3 = (
                    statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
                )
                row = {
                    "request_bytes": bs,
                    "queue_depth": qd,
                    "fio_best": fio_best.split(":")[1],
                    "fio_gbps": statistics.median(p[0] for p in pairs),
                    "moepack_best": moe_best.split(":")[1],
                    "moepack_gbps": statistics.median(p[1] for p in pairs),
                    "ratio": statistics.median(ratios),
                    "ratio_q1": q1,
                    "ratio_q3": q3,
                    "pair_ratios": ratios,
                    "pairs_gbps": pairs,
                    "phase1_medians_gbps": med,
                    "phase1_runs_gbps": runs,
                }
                results.append(row)
                detail = "  ".join(f"{k}={v:.3f}" for k, v in med.items())
                print(f"  {format_size(bs):>4} QD{qd:<2} {detail}")
                print(
                    f"{'':10}pairs {fio_best} vs {moe_best}: "
                    + " ".join(f"{r:.2f}" for r in ratios)
                )
                sys.stdout.flush()
    return results


def overhead(path: Path, seconds: float) -> dict[str, float]:
    """Microseconds per 4 KiB request served from the page cache: the Python-side cost."""
    out = {}
    with open_file(path, Mode.BUFFERED) as f:
        for eng, qd in [("pread", 1), ("mmap", 1), ("uring", 1), ("uring", 8), ("threads", 8)]:
            fd = os.open(path, os.O_RDONLY)
            os.pread(fd, f.size, 0)  # warm the cache: no device wait below
            os.close(fd)
            work = RandomWork(f.size, 4096, wrap=True, seed=1)
            t0 = time.perf_counter_ns()
            work.start(seconds)
            get_engine(eng).run(f, work, qd)
            dt = time.perf_counter_ns() - t0
            out[f"{eng} QD{qd}"] = dt / 1e3 / max(1, len(work.latencies))
    return out


def buffer_effect(path: Path, seconds: float, rounds: int) -> list[dict]:
    """moepack with ordinary 4 KiB-page buffers vs transparent-huge-page buffers."""
    out = []
    with open_file(path, Mode.DIRECT) as f:
        for eng, bs, qd in [("pread", 1 << 20, 1), ("uring", 1 << 20, 8), ("threads", 65536, 32)]:
            got: dict[bool, list[float]] = {True: [], False: []}
            for rnd in range(rounds):
                for huge in (True, False) if rnd % 2 else (False, True):
                    buffers.use_huge_pages = huge
                    cell = measure_cell(f, get_engine(eng), bs, qd, seconds, 3000 + rnd)
                    got[huge].append(cell.bytes_per_sec / 1e9)
            buffers.use_huge_pages = True
            small, big = statistics.median(got[False]), statistics.median(got[True])
            out.append({"engine": eng, "request_bytes": bs, "queue_depth": qd,
                        "pages_4k_gbps": small, "huge_pages_gbps": big})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp/moepack-bench", help="folder for the test file")
    ap.add_argument("--file-size", default="4G", help="size of the test file (default 4G)")
    ap.add_argument("--seconds", type=float, default=0.5, help="time per run")
    ap.add_argument("--rounds", type=int, default=3, help="phase 1: rounds of every engine")
    ap.add_argument("--pairs", type=int, default=15, help="phase 2: back-to-back pairs")
    ap.add_argument("--json", help="also write every run here")
    args = ap.parse_args()

    fio = ensure_fio()
    version = subprocess.run([fio, "--version"], capture_output=True, text=True).stdout.strip()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    corpus = ensure_corpus(args.dir, parse_size(args.file_size))
    f_engines = fio_engines(fio)
    print(f"{version}; file {corpus.path} ({corpus.size / 2**30:.1f} GiB), O_DIRECT randread")
    print(
        f"{args.seconds:g} s per run; {args.rounds} rounds of every engine, then {args.pairs} "
        "back-to-back pairs of the two best"
    )
    print(
        f"fio engines {', '.join(f_engines)}; moepack engines pread/threads, uring, uring-batch\n"
    )
    results = compare(fio, corpus.path, f_engines, args)

    print()
    head = (
        f"{'size':>5} {'QD':>3} | {'fio best (pairs)':>20} | {'moepack best (pairs)':>24} "
        "| ratio | middle half"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        flag = "" if r["ratio"] >= 0.9 else "  < 0.9"
        print(
            f"{format_size(r['request_bytes']):>5} {r['queue_depth']:>3} | "
            f"{r['fio_gbps']:6.3f} GB/s {r['fio_best']:>9} | "
            f"{r['moepack_gbps']:6.3f} GB/s {r['moepack_best']:>13} | {r['ratio']:5.2f} "
            f"| {r['ratio_q1']:.2f}..{r['ratio_q3']:.2f}{flag}"
        )
    worst = min(r["ratio"] for r in results)
    print("\nratio = median over back-to-back pairs of moepack's best / fio's best engine")
    print(f"worst cell {worst:.2f} (target >= 0.90)")

    if buffers.huge_page_size():
        print("\nmoepack's buffers: 4 KiB pages vs transparent huge pages (median GB/s):")
        effect = buffer_effect(corpus.path, args.seconds, 6)
        for e in effect:
            print(
                f"  {e['engine']:<8} {format_size(e['request_bytes']):>4} QD{e['queue_depth']:<3}"
                f" {e['pages_4k_gbps']:6.3f} -> {e['huge_pages_gbps']:6.3f} "
                f"({e['huge_pages_gbps'] / e['pages_4k_gbps']:.2f}x)"
            )
    else:
        effect = []

    small = Path(args.dir) / "overhead.bin"
    small.write_bytes(os.urandom(64 << 20))
    try:
        ovh = overhead(small, 1.0)
    finally:
        small.unlink()
    print("\nPython-side cost per request (4 KiB, page-cache hits, no device wait):")
    for k, v in ovh.items():
        print(f"  {k:<12} {v:6.1f} µs/request")
    if args.json:
        doc = {"fio": version, "cells": results, "buffers": effect, "overhead_us": ovh}
        Path(args.json).write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
