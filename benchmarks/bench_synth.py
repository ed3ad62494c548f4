"""Writing a large synthetic model with planted routing: time against a plain streaming write
of the same number of bytes (the yardstick, measured in the same run), and peak RSS against
the file size (memory must stay bounded by one tensor, not the model).

    .venv/bin/python benchmarks/bench_synth.py                  # 32 layers x 64 experts, Q8_0
    .venv/bin/python benchmarks/bench_synth.py --layers 8 --expert-ffn 256 --weight-type F32
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HWM = (
    "\nimport re\n"
    "print('HWM', re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
)


def child(code: str) -> tuple[float, float]:
    """Run ``code`` in a fresh interpreter; return (seconds, its own peak RSS in MiB)."""
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code + _HWM], capture_output=True, text=True)
    elapsed = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"child failed: {proc.stderr.strip()[-500:]}")
    return elapsed, int(proc.stdout.split("HWM")[-1]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--expert-ffn", type=int, default=512)
    ap.add_argument("--weight-type", default="Q8_0")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="moepack-bench-synth-", dir=args.dir))
    model = folder / "m.gguf"
    spec = (
        f"SynthSpec(layers={args.layers}, experts={args.experts}, top_k=8, hidden=1024, "
        f"expert_ffn={args.expert_ffn}, heads=8, kv_heads=2, head_dim=128, vocab=4096, "
        f"weight_type={args.weight_type!r}, "
        "routing=RoutingSpec(cluster_size=8, stay=0.8, coupling=0.95, skew=1.0))"
    )
    try:
        synth_s, synth_mb = child(
            "from moepack.checkpoint.synth import SynthSpec, synth_model\n"
            "from moepack.checkpoint.routing import RoutingSpec\n"
            f"synth_model({str(model)!r}, {spec})\n"
        )
        size = model.stat().st_size
        model.unlink()
        plain = folder / "plain.bin"
        write_s, write_mb = child(
            "import os, numpy as np\n"
            f"left = {size}\n"
            "block = np.random.default_rng(0).bytes(64 << 20)\n"
            f"with open({str(plain)!r}, 'wb') as f:\n"
            "    while left > 0:\n"
            "        n = min(left, len(block)); f.write(block[:n]); left -= n\n"
            "    f.flush(); os.fsync(f.fileno())\n"
        )
        plain.unlink()
    finally:
        for p in folder.iterdir():
            p.unlink()
        os.rmdir(folder)
    gib = size / 2**30
    print(f"model: {spec}")
    print(f"file            {gib:8.2f} GiB")
    print(f"synth           {synth_s:8.1f} s   peak RSS {synth_mb:7.0f} MiB")
    print(f"plain write     {write_s:8.1f} s   peak RSS {write_mb:7.0f} MiB  (yardstick)")
    print(f"ratio synth / plain write: {synth_s / write_s:.1f}x time")
    print(f"peak RSS / file size: {synth_mb / (size / 2**20):.3f}")


if __name__ == "__main__":
    main()
