"""Writing a large synthetic model: time against a plain streaming write of the same number of
bytes (the yardstick, measured in the same run), seconds per GB, and peak RSS against the file
size (memory must stay bounded by a chunk per worker, not the model).

A slice of a published shape times the real tensors without writing the whole model
(``--shape qwen3-30b-a3b --layers 4``: 4 of its 48 layers, with its embedding and head).
``--against SRC`` times the moepack in another checkout's ``src`` too (``git worktree add
/tmp/main main`` then ``--against /tmp/main/src``): the two run alternately, round after round,
so that what other users of the machine do falls on both, and medians are reported.

    .venv/bin/python benchmarks/bench_synth.py                  # 32 layers x 64 experts, Q8_0
    .venv/bin/python benchmarks/bench_synth.py --shape qwen3-30b-a3b --layers 4 --weight-type Q4_0
    .venv/bin/python benchmarks/bench_synth.py --shape qwen3-30b-a3b --layers 1 --vocab 32768 \\
        --weight-type Q4_K_M --repeats 3 --against /tmp/main/src
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from headline import record

_HWM = (
    "\nimport re\n"
    "print('HWM', re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
)
# The spec without a shape: planted routing on a mid-sized model.
_DEFAULT = dict(
    layers=32,
    experts=64,
    top_k=8,
    hidden=1024,
    expert_ffn=512,
    heads=8,
    kv_heads=2,
    head_dim=128,
    vocab=4096,
)
_ROUTING = "RoutingSpec(cluster_size=8, stay=0.8, coupling=0.95, skew=1.0)"


def child(code: str, src: str | None = None) -> tuple[float, float]:
    """Run ``code`` in a fresh interpreter (importing moepack from ``src`` when given);
    return (seconds, its own peak RSS in MiB)."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = src
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code + _HWM], capture_output=True, text=True, env=env
    )
    elapsed = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"child failed: {proc.stderr.strip()[-800:]}")
    return elapsed, int(proc.stdout.split("HWM")[-1]) / 1024


def spec_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The spec's fields as plain values (a shape resolved here, so an older moepack without
    shapes can write the same model)."""
    if args.shape:
        from moepack.checkpoint.shapes import get_shape

        fields: dict[str, Any] = dict(get_shape(args.shape).sizes)
    else:
        fields = dict(_DEFAULT)
    for name in ("layers", "experts", "expert_ffn", "vocab"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    fields["weight_type"] = args.weight_type
    return fields


def synth_code(fields: dict[str, Any], routing: bool, model: Path, threads: int | None) -> str:
    spec = "SynthSpec(" + ", ".join(f"{k}={v!r}" for k, v in fields.items())
    spec += f", routing={_ROUTING})" if routing else ")"
    extra = f", threads={threads}" if threads else ""
    return (
        "from moepack.checkpoint.synth import SynthSpec, synth_model\n"
        "from moepack.checkpoint.routing import RoutingSpec\n"
        f"synth_model({str(model)!r}, {spec}{extra})\n"
    )


def plain_write(path: Path, size: int) -> tuple[float, float]:
    return child(
        "import os, numpy as np\n"
        f"left = {size}\n"
        "block = np.random.default_rng(0).bytes(64 << 20)\n"
        f"with open({str(path)!r}, 'wb') as f:\n"
        "    while left > 0:\n"
        "        n = min(left, len(block)); f.write(block[:n]); left -= n\n"
        "    f.flush(); os.fsync(f.fileno())\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default=None, help="a published shape (moepack synth --shape)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--expert-ffn", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--weight-type", default="Q8_0")
    ap.add_argument("--threads", type=int, default=None, help="synth workers (default: cores)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--against", default=None, help="another moepack's src folder to time too")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    fields = spec_fields(args)
    routing = not args.shape
    folder = Path(tempfile.mkdtemp(prefix="moepack-bench-synth-", dir=args.dir))
    model, plain = folder / "m.gguf", folder / "plain.bin"
    variants: list[tuple[str, str | None]] = [("this", None)]
    if args.against:
        variants.append(("against", args.against))
    runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name, _ in variants}
    writes: list[tuple[float, float]] = []
    try:
        for r in range(args.repeats):
            order = variants if r % 2 == 0 else variants[::-1]
            for name, src in order:
                threads = args.threads if src is None else None
                s, mb = child(synth_code(fields, routing, model, threads), src)
                size = model.stat().st_size
                model.unlink()
                runs[name].append((s, mb, size))
                print(f"round {r + 1} {name:8s} {s:8.1f} s  {size / s / 1e9:.3f} GB/s", flush=True)
            size = runs["this"][-1][2]
            writes.append(plain_write(plain, size))
            plain.unlink()
    finally:
        for p in folder.iterdir():
            p.unlink()
        os.rmdir(folder)
    write_s = statistics.median(w[0] for w in writes)
    print(f"model: {fields}{' with planted routing' if routing else ''}")
    print(f"rounds: {args.repeats} (medians)")
    print(f"plain write     {write_s:8.1f} s   peak RSS {max(w[1] for w in writes):7.0f} MiB")
    for name, src in variants:
        s = statistics.median(x[0] for x in runs[name])
        mb = max(x[1] for x in runs[name])
        size = runs[name][-1][2]
        gb = size / 1e9
        print(
            f"{name:8s} ({src or 'this checkout'}): file {gb:.3f} GB, {s:8.1f} s = "
            f"{s / gb:6.1f} s/GB, {s / write_s:5.1f}x the plain write, peak RSS {mb:6.0f} MiB "
            f"({mb / (size / 2**20):.3f} of the file)"
        )
    if args.against:
        a = statistics.median(x[0] for x in runs["this"])
        b = statistics.median(x[0] for x in runs["against"])
        print(f"this / against: {a / b:.2f}x the time ({b / a:.2f}x as fast)")
    record_headline(args, fields, runs, write_s)


def record_headline(
    args: argparse.Namespace,
    fields: dict[str, Any],
    runs: dict[str, list[tuple[float, float, int]]],
    write_s: float,
) -> None:
    """This checkout's time against the plain write, as benchmarks/README.md's table shows it."""
    s = statistics.median(x[0] for x in runs["this"])
    mb = max(x[1] for x in runs["this"])
    size = runs["this"][-1][2]
    if args.shape:
        model = f"{args.shape}'s shape, {fields['layers']} layers with its embedding and head"
    else:
        model = f"{fields['layers']} layers × {fields['experts']} experts, planted routing"
    figures: dict[str, float | int | str | bool | None] = {
        "synth s": s,
        "s/GB": s / (size / 1e9),
        "file GB": size / 1e9,
        "peak RSS MiB": mb,
        "plain write s": write_s,
        "rounds": args.repeats,
    }
    detail = f"peak RSS {mb:.0f} MiB"
    if args.against:
        b = statistics.median(x[0] for x in runs["against"])
        figures |= {f"{args.against} s": b, f"as fast as {args.against}": b / s}
        detail = f"{b / s:.2f}× as fast as {args.against} ({b:.1f} s); " + detail
    record(
        "synth",
        title="Synthetic model writer",
        what="writing a slice of a published shape, time"
        if args.shape
        else "writing a model, time",
        ratio=s / write_s,
        yardstick="a plain streaming write of as many bytes",
        yardstick_value=write_s,
        unit="s",
        figures=figures,
        detail=detail,
        model=f"{model}, {fields['weight_type']}, {size / 1e9:.3f} GB",
    )


if __name__ == "__main__":
    main()
