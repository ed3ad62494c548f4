"""moepack's read engines against fio, measured in the same run on the same file.

Random reads of 64 KiB and 1 MiB at queue depth 1, 8 and 32, O_DIRECT, one file. For every
cell each tool runs each of its engines once per round, interleaved (fio, moepack, fio, ...)
so drift on a shared machine hits both alike; a tool's figure is its best engine's median
over the rounds. Target: moepack's best / fio's best >= 0.9 in every cell.

    .venv/bin/python benchmarks/bench_storage.py [--dir /var/tmp/moepack-bench]
        [--file-size 4G] [--seconds 2] [--rounds 3] [--json out.json]

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
from pathlib import Path

from moepack.storage.corpus import ensure_corpus
from moepack.storage.engine import get_engine
from moepack.storage.measure import measure_cell
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
    out = subprocess.run([fio, "--enghelp"], capture_output=True, text=True).stdout
    return [e for e in ("io_uring", "libaio", "psync") if e in out.split()]


def run_fio(fio: str, path: Path, engine: str, bs: int, qd: int, seconds: float) -> dict:
    cmd = [
        fio, "--name=bench", f"--filename={path}", "--rw=randread", f"--bs={bs}",
        f"--iodepth={qd}", "--direct=1", f"--ioengine={engine}", f"--runtime={seconds}",
        "--time_based", "--randrepeat=0", "--output-format=json",
    ]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"fio {engine} failed: {p.stderr.strip()[-300:]}")
    job = json.loads(p.stdout[p.stdout.index("{") :])["jobs"][0]
    cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100 * seconds
    bw = job["read"]["bw_bytes"]
    return {"bytes_per_sec": bw, "cpu_sec_per_gb": cpu / (bw * seconds / 1e9) if bw else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp/moepack-bench", help="folder for the test file")
    ap.add_argument("--file-size", default="4G", help="size of the test file (default 4G)")
    ap.add_argument("--seconds", type=float, default=2.0, help="time per run")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per cell")
    ap.add_argument("--json", help="also write every run here")
    args = ap.parse_args()

    fio = ensure_fio()
    version = subprocess.run([fio, "--version"], capture_output=True, text=True).stdout.strip()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    corpus = ensure_corpus(args.dir, parse_size(args.file_size))
    f_engines = fio_engines(fio)
    print(f"{version}; file {corpus.path} ({corpus.size / 2**30:.1f} GiB, O_DIRECT)")
    print(f"{args.rounds} interleaved rounds of {args.seconds:g} s per engine and cell\n")

    results = []
    with open_file(corpus.path, Mode.DIRECT) as f:
        for bs in SIZES:
            for qd in DEPTHS:
                m_engines = ["pread", "uring"] if qd == 1 else ["threads", "uring", "uring-batch"]
                fio_e = [e for e in f_engines if qd == 1 or e != "psync"]
                runs: dict[str, list[float]] = {}
                cpu: dict[str, list[float]] = {}
                for rnd in range(args.rounds):
                    order = [("fio", e) for e in fio_e] + [("moepack", e) for e in m_engines]
                    # interleave: fio, moepack, fio, moepack ...
                    fio_part = [o for o in order if o[0] == "fio"]
                    moe_part = [o for o in order if o[0] == "moepack"]
                    mixed = []
                    for i in range(max(len(fio_part), len(moe_part))):
                        mixed += fio_part[i : i + 1] + moe_part[i : i + 1]
                    if rnd % 2:
                        mixed.reverse()
                    for tool, eng in mixed:
                        key = f"{tool}:{eng}"
                        if tool == "fio":
                            r = run_fio(fio, corpus.path, eng, bs, qd, args.seconds)
                            bw, c = r["bytes_per_sec"], r["cpu_sec_per_gb"]
                        else:
                            cell = measure_cell(
                                f, get_engine(eng), bs, qd, args.seconds, seed=rnd * 101 + qd
                            )
                            bw, c = cell.bytes_per_sec, cell.cpu_sec_per_gb
                        runs.setdefault(key, []).append(bw)
                        cpu.setdefault(key, []).append(c or 0.0)
                med = {k: statistics.median(v) for k, v in runs.items()}
                fio_best = max((k for k in med if k.startswith("fio:")), key=med.__getitem__)
                moe_best = max((k for k in med if k.startswith("moepack:")), key=med.__getitem__)
                row = {
                    "request_bytes": bs,
                    "queue_depth": qd,
                    "fio_best": fio_best.split(":")[1],
                    "fio_gbps": med[fio_best] / 1e9,
                    "moepack_best": moe_best.split(":")[1],
                    "moepack_gbps": med[moe_best] / 1e9,
                    "ratio": med[moe_best] / med[fio_best],
                    "medians_gbps": {k: v / 1e9 for k, v in med.items()},
                    "cpu_sec_per_gb": {k: statistics.median(v) for k, v in cpu.items()},
                    "runs_gbps": {k: [x / 1e9 for x in v] for k, v in runs.items()},
                }
                results.append(row)
                detail = "  ".join(f"{k}={v:.3f}" for k, v in row["medians_gbps"].items())
                print(f"  {format_size(bs):>4} QD{qd:<2} {detail}", flush=True)

    print()
    head = f"{'size':>5} {'QD':>3} | {'fio best':>18} | {'moepack best':>22} | {'ratio':>5}"
    print(head)
    print("-" * len(head))
    for r in results:
        ok = "" if r["ratio"] >= 0.9 else "  < 0.9"
        print(
            f"{format_size(r['request_bytes']):>5} {r['queue_depth']:>3} | "
            f"{r['fio_gbps']:6.3f} GB/s {r['fio_best']:>8} | "
            f"{r['moepack_gbps']:6.3f} GB/s {r['moepack_best']:>12} | {r['ratio']:5.2f}{ok}"
        )
    worst = min(r["ratio"] for r in results)
    print(f"\nworst ratio {worst:.2f} (target >= 0.90)")
    if args.json:
        Path(args.json).write_text(json.dumps({"fio": version, "cells": results}, indent=2))


if __name__ == "__main__":
    main()
