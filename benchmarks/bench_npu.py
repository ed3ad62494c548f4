"""NPU packer benchmark: speed against a numpy copy, and memory against one layer's buffers.

    .venv/bin/python benchmarks/bench_npu.py                  # one full-geometry linear layer
    .venv/bin/python benchmarks/bench_npu.py --full-model     # + a 40-layer synthetic model (~21 GB)

1. Speed: pack one full-geometry linear layer (flm-0.9.46: weights 533 MB + router + norms) in
   memory, and, in the same run, copy the same source bytes with numpy (``np.copyto`` from the
   same memory map into a fresh buffer). Each repeat maps the file afresh so both pay the same
   page faults. Target: pack <= 2x copy.
2. Memory: ``moepack npu pack`` (library call, files written, sha256 computed) in a child
   process; its peak RSS (VmHWM) against the sum of one layer's buffers. Target <= 2.5x.
3. ``--full-model``: a 40-layer synthetic model packed in a child process, sampling RSS after
   each layer: the peak must not grow with the layer count. Needs ~45 GB free (checked).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from moepack.npu.geometry import detect
from moepack.npu.packer import layer_plan, pack_buffer
from moepack.npu.profiles import get_profile
from moepack.npu.q4nx import Q4nxFile
from moepack.npu.synth import synth


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class RssSampler:
    """A ProgressSink that records VmRSS whenever a layer's work advances."""

    def __init__(self) -> None:
        self.samples: list[int] = []
        self._last = 0.0

    def start(self, description: str, total: int, unit: str = "B") -> None:
        pass

    def advance(self, amount: int) -> None:
        now = time.monotonic()
        if now - self._last > 0.05:
            self.samples.append(status_kb("VmRSS"))
            self._last = now

    def finish(self) -> None:
        self.samples.append(status_kb("VmRSS"))


def child(model: str, out: str, layers: str, profile: str) -> None:
    """Runs in a subprocess: pack, then report peak memory as JSON on stdout."""
    from moepack.npu.packer import pack_model

    sampler = RssSampler()
    base = status_kb("VmRSS")
    t0 = time.perf_counter()
    res = pack_model(model, out, profile, layers, sampler, force=True)
    dt = time.perf_counter() - t0
    per_layer = {}
    for b in res.buffers:
        per_layer[b.layer] = per_layer.get(b.layer, 0) + b.size
    print(json.dumps({
        "seconds": dt, "vmhwm_kb": status_kb("VmHWM"), "start_rss_kb": base,
        "rss_samples_kb": sampler.samples, "layer_bytes": max(per_layer.values()),
        "total_bytes": res.total_bytes, "layers": len(res.layers),
    }))  # fmt: skip


def run_child(model: Path, out: Path, layers: str, profile: str) -> dict:
    cmd = [sys.executable, __file__, "--child", str(model), str(out), layers, profile]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def time_layer(model: Path, layer: int, profile: str, repeat: int) -> None:
    prof = get_profile(profile)
    packs, copies = [], []
    with Q4nxFile(model) as m:  # warm the page cache once, untimed
        np.copyto(np.empty(m.size, np.uint8), m.u8)
    for _ in range(repeat):
        with Q4nxFile(model) as m:  # fresh map: page faults paid again
            plan = layer_plan(m, prof, detect(m), layer)
            t0 = time.perf_counter()
            bufs = [pack_buffer(m, bp) for bp in plan.buffers]
            packs.append(time.perf_counter() - t0)
            total = sum(b.size for b in bufs)
            del bufs
        with Q4nxFile(model) as m:
            refs = list(plan.tensors.values())
            t0 = time.perf_counter()
            dst = np.empty(total, np.uint8)
            at = 0
            for r in refs:
                np.copyto(dst[at : at + r.nbytes], m.u8[r.start : r.start + r.nbytes])
                at += r.nbytes
            copies.append(time.perf_counter() - t0)
            del dst
    placed = sum(r.nbytes for r in refs)
    ratios = [p / c for p, c in zip(packs, copies, strict=True)]
    print(f"layer {layer} ({profile}): {total:,} B of buffers from {placed:,} B of tensors")
    print("  pack  : " + ", ".join(f"{t * 1000:.0f} ms" for t in packs))
    print("  copy  : " + ", ".join(f"{t * 1000:.0f} ms" for t in copies))
    print("  ratio : " + ", ".join(f"{r:.2f}x" for r in ratios)
          + f"  (median {statistics.median(ratios):.2f}x, target <= 2x)")  # fmt: skip


def report_memory(tag: str, r: dict) -> float:
    peak = r["vmhwm_kb"] * 1024
    ratio = peak / r["layer_bytes"]
    print(f"{tag}: {r['layers']} layer(s), {r['total_bytes']:,} B in {r['seconds']:.1f} s; "
          f"peak RSS {peak / 2**20:.0f} MiB = {ratio:.2f}x one layer's buffers "
          f"({r['layer_bytes'] / 2**20:.0f} MiB; target <= 2.5x)")  # fmt: skip
    return ratio


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", type=Path, help="a full-geometry .q4nx (default: synthesise layer 0)"
    )
    ap.add_argument("--profile", default="flm-0.9.46")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--full-model", action="store_true", help="also pack a 40-layer model (~21 GB)")
    ap.add_argument("--workdir", type=Path, default=None, help="where temporary files go")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    work = Path(tempfile.mkdtemp(prefix="bench-npu-", dir=args.workdir))
    try:
        model = args.model
        if model is None:
            model = work / "layer0.q4nx"
            t0 = time.perf_counter()
            synth(model, "full", "0")
            print(f"synthesised {model.stat().st_size:,} B (full geometry, layer 0) in "
                  f"{time.perf_counter() - t0:.1f} s")  # fmt: skip
        time_layer(model, 0, args.profile, args.repeat)
        report_memory("pack (child process)", run_child(model, work / "pack1", "0", args.profile))
        shutil.rmtree(work / "pack1", ignore_errors=True)
        if args.full_model:
            need = 2 * 21_800_000_000 + 2_000_000_000
            free = shutil.disk_usage(work).free
            if free < need:
                print(f"--full-model skipped: needs {need:,} B free in {work}, {free:,} are")
                return
            big = work / "model40.q4nx"
            t0 = time.perf_counter()
            synth(big, "full", "0-39")
            print(
                f"synthesised 40 layers, {big.stat().st_size:,} B in {time.perf_counter() - t0:.0f} s"
            )
            one = run_child(big, work / "pack-one", "0", args.profile)
            shutil.rmtree(work / "pack-one", ignore_errors=True)
            r = run_child(big, work / "pack40", "0-39", args.profile)
            report_memory("1 layer of the 40-layer file", one)
            report_memory("all 40 layers", r)
            s = r["rss_samples_kb"]
            q = max(1, len(s) // 4)
            print("  RSS max per quarter of the run (MiB): "
                  + ", ".join(f"{max(s[i:i + q]) / 1024:.0f}" for i in range(0, len(s), q)))  # fmt: skip
            print(f"  growth 40 layers vs 1 layer: {r['vmhwm_kb'] / one['vmhwm_kb']:.3f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
