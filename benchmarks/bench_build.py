"""llama.cpp built for this CPU against the portable build, in the same run: ``moepack run``'s
prefill and decode tokens/s with side A's llama-cpp-python (by default this venv's: the native
build ``./dev`` installs) and side B's (by default the portable build, ``-DGGML_NATIVE=OFF``,
taken from moepack's cache of builds and compiled into it once if missing), as A/B ratios.

Both sides run this checkout's moepack; only llama.cpp differs. A side is a Python (another
venv's llama-cpp-python), a wheel (unpacked once into ``--dir`` and put ahead on
``PYTHONPATH`` of this Python), ``portable`` or ``this``. Every measured run is a fresh process
(``run_model``: a llama.cpp worker), A and B take turns, the order reversed each round, and a
ratio is taken pair by pair (the machine's speed drifts between pairs, not within one). The
models are ``bench_run``'s planted-routing qwen3moe (64 experts, top-8, hidden 1024, expert
FFN 512) at ``LAYERS`` per weight type, about 1.4 GB each, written once into ``--dir``. Each
run prefills a prompt of two of its topic prompts (about 256 tokens) and then decodes
``--tokens`` tokens of the next prompt's text one at a time (``continuation``: the same tokens
on both sides, so their logits compare). Parts:

- ``cached``: the whole file in the page cache (read through before each run), llama.cpp's
  own placement (``defaults``: Q4_0 and Q4_K repacked at load), no prefetcher: the compute;
- ``pressure``: under the memory holder (``--leave``), the file's pages dropped before each
  run: the expert prefetcher with the pager (what ``run`` chooses where a model does not fit)
  at a budget of ``--memory``, under half of each model's experts. A run counts only if the
  holder held through it.

Printed per weight type, part and thread count (both phases at that count): A's and B's median
tok/s (range) for prefill and decode, the median of the per-pair ratios A/B (range), the same
of B's CPU time per token over A's (less swayed by a busy machine's other work than wall
time), and how far A's logits are from B's (the kernels sum in other orders). The headline
(``results/native-build.json``) is the first weight type's cached prefill at the most threads.

    .venv/bin/python benchmarks/bench_build.py          # native (this venv) vs portable
    .venv/bin/python benchmarks/bench_build.py --types Q4_0 --parts cached --rounds 5
    .venv/bin/python benchmarks/bench_build.py --b path/to/llama_cpp_python-0.3.36-...whl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_run  # noqa: E402
from headline import record  # noqa: E402
from memhold import MemoryHold, parse_size  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SRC = ROOT / "src"
LAYERS = {"Q8_0": 12, "Q4_0": 24, "Q4_K_M": 22}
"""About 1.4 GB each: more than the pager keeps under the holder, small enough to write quickly."""
PHASES = ("prefill", "decode")

IDENTIFY = """
import json, llama_cpp
from moepack.llama.runtime import ggml_backend as g
print(json.dumps({"llama_cpp": llama_cpp.__file__, "version": llama_cpp.__version__,
                  "features": sorted(g.cpu_features()), "extra_bufts": sorted(g.cpu_extra_bufts())}))
"""


@dataclass(frozen=True)
class Side:
    """One build: the Python that runs it and a folder put ahead on its ``PYTHONPATH``."""

    name: str
    python: str
    path: Path | None = None

    def env(self) -> dict[str, str]:
        """This checkout's moepack (and the side's llama-cpp-python) ahead of the venv's."""
        env = dict(os.environ)
        ahead = [str(p) for p in (self.path, SRC) if p is not None]
        env["PYTHONPATH"] = os.pathsep.join([*ahead, *filter(None, [env.get("PYTHONPATH")])])
        return env


def unpacked(wheel: Path, folder: Path) -> Path:
    """``wheel`` installed (no dependencies) into a folder of its own under ``folder``, once."""
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()[:12]
    target = folder / "builds" / f"{wheel.stem}-{digest}"
    if not (target / "llama_cpp").is_dir():
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(tmp), str(wheel)], check=True)  # fmt: skip
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    return target


def portable_wheel() -> Path:
    """The portable build from moepack's cache, compiled into it first if missing."""
    from moepack.cachedir import cache_dir
    from moepack.llamabuild import PORTABLE_ARGS, BuildKey, build_wheel, llama_requirement

    key = BuildKey.here(llama_requirement(ROOT / "pyproject.toml"), PORTABLE_ARGS)
    return build_wheel(key, cache_dir(), log=lambda line: print(f"    {line}", flush=True))


def resolve(spec: str, folder: Path) -> Side:
    """A side from ``this``, ``portable``, a wheel or a Python."""
    if spec == "this":
        return Side(spec, sys.executable)
    if spec == "portable":
        return Side(spec, sys.executable, unpacked(portable_wheel(), folder))
    if spec.endswith(".whl"):
        return Side(Path(spec).name, sys.executable, unpacked(Path(spec), folder))
    return Side(spec, spec)


def identify(side: Side) -> dict[str, Any]:
    """The llama-cpp-python a side runs, its CPU backend's compiled features and extra
    buffer types."""
    out = subprocess.run([side.python, "-c", IDENTIFY], capture_output=True, text=True,
                         env=side.env(), check=True)  # fmt: skip
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


@dataclass
class Run:
    """One measured run of one build."""

    prefill: float
    decode: float
    prompt_tokens: int
    cpu_ms: dict[str, float]  # CPU milliseconds per token, per phase (all threads)
    held: bool = True
    weights: dict[str, Any] = field(default_factory=dict)


def other_holders() -> list[int]:
    """Memory holders of other processes (another benchmark on this machine)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"moepack.memhold" in cmd and int(proc.name) != os.getpid():
            found.append(int(proc.name))
    return found


def wait_for_other_holders() -> None:
    """Hold memory only when nobody else does: two holders starve each other's runs."""
    said = False
    while other_holders():
        if not said:
            print("    waiting: another memory holder is running", flush=True)
            said = True
        time.sleep(30)


def one_run(job: dict[str, Any]) -> dict[str, Any]:
    """Inside the measuring Python: one ``run_model`` as the job says; what it measured."""
    from moepack.llama.prefetcher.streamer import StreamOptions
    from moepack.llama.runtime.run import RunOptions, run_model

    prefetch = StreamOptions(pager="on", memory=job["memory"]) if job["pressure"] else None
    opts = RunOptions(n_predict=job["tokens"], threads=job["threads"],
                      threads_batch=job["threads"], n_ctx=1024, batch=512,
                      placement="auto" if job["pressure"] else "defaults", prefetch=prefetch,
                      cold=job["pressure"], spin=job["spin"])  # fmt: skip
    r = run_model(job["model"], job["prompt"], opts, continuation=job["continuation"],
                  logits_out=job["logits"])  # fmt: skip
    w = r.weights or {}
    cpu = {p: x.to_json()["cpu_seconds"] / max(1, x.tokens) for p, x in
           (("prefill", r.prefill), ("decode", r.decode))}  # fmt: skip
    return {
        "prefill": r.prefill.tokens_per_second,
        "decode": r.decode.tokens_per_second,
        "cpu_ms": {p: 1e3 * v for p, v in cpu.items()},
        "prompt_tokens": r.prompt_tokens,
        "weights": {k: w.get(k) for k in ("placement", "experts_mapped", "buffer_types")},
    }


def measure(side: Side, job: dict[str, Any]) -> Run:
    proc = subprocess.run([side.python, __file__, "--one", json.dumps(job)], capture_output=True,
                          text=True, env=side.env())  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{side.name}: the run failed:\n{proc.stderr[-2000:]}")
    d = json.loads(proc.stdout.strip().splitlines()[-1])
    return Run(d["prefill"], d["decode"], d["prompt_tokens"], d["cpu_ms"], weights=d["weights"])


def compare(a: Path, b: Path) -> str:
    """``same`` when the logits are equal bit for bit, else the largest difference."""
    x, y = np.load(a), np.load(b)
    if x.shape != y.shape:
        return f"shapes {x.shape} / {y.shape}"
    if np.array_equal(x, y):
        return "same"
    d = float(np.abs(x - y).max())
    return f"max |d| {d:.2g} ({d / float(y.std()):.2g} sd)"


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f} ({min(values):.2f}-{max(values):.2f})"


@dataclass
class Cell:
    """One weight type, part and thread count: per phase, A's and B's median tok/s and the
    median of the per-pair ratios A/B."""

    wtype: str
    part: str
    threads: int
    a: dict[str, float] = field(default_factory=dict)
    b: dict[str, float] = field(default_factory=dict)
    ratio: dict[str, float] = field(default_factory=dict)


def cell(args: argparse.Namespace, sides: dict[str, Side], wtype: str, part: str, threads: int,
         model: Path, prompts: list[str], scratch: Path) -> Cell | None:  # fmt: skip
    """A and B ``args.rounds`` times each, alternated, on one model, part and thread count."""
    pressure = part == "pressure"
    job = {"model": str(model), "prompt": " ".join(prompts[:2]), "continuation": prompts[2],
           "tokens": args.tokens, "threads": threads, "pressure": pressure,
           "memory": parse_size(args.memory), "spin": args.spin}  # fmt: skip
    runs: dict[str, list[Run]] = {"A": [], "B": []}
    logits: list[str] = []
    hold: MemoryHold | None = None
    try:
        for rnd in range(args.rounds):
            for name in ("A", "B") if rnd % 2 == 0 else ("B", "A"):
                out = scratch / f"{name}.npy"
                if pressure:
                    if hold is None or not hold.alive():
                        if hold is not None:
                            hold.__exit__(None, None, None)
                        wait_for_other_holders()
                        hold = MemoryHold(parse_size(args.leave), args.hold_floor).__enter__()
                    bench_run.drop_confirmed(model)
                else:
                    bench_run.warm(model)
                r = measure(sides[name], job | {"logits": str(out)})
                r.held = hold.alive() if hold is not None else True
                runs[name].append(r)
            logits.append(compare(scratch / "A.npy", scratch / "B.npy"))
            a, b = runs["A"][-1], runs["B"][-1]
            print(f"    {wtype} {part} t{threads} round {rnd + 1}: prefill A {a.prefill:.1f} "
                  f"B {b.prefill:.1f}, decode A {a.decode:.2f} B {b.decode:.2f} tok/s, "
                  f"held {a.held and b.held}, logits {logits[-1]}", flush=True)  # fmt: skip
    finally:
        if hold is not None:
            hold.__exit__(None, None, None)
    pairs = [(a, b) for a, b in zip(runs["A"], runs["B"], strict=True) if a.held and b.held]
    if not pairs:
        print(f"  {wtype:7} {part:8} t{threads}: no pair the holder held through")
        return None
    out_cell = Cell(wtype, part, threads)
    for phase in PHASES:
        av = [getattr(a, phase) for a, _ in pairs]
        bv = [getattr(b, phase) for _, b in pairs]
        ratios = [x / y for x, y in zip(av, bv, strict=True) if y > 0]
        # CPU time per token: B's over A's (above 1: A computes the token with less CPU)
        cpu = [b.cpu_ms[phase] / a.cpu_ms[phase] for a, b in pairs if a.cpu_ms[phase] > 0]
        out_cell.a[phase], out_cell.b[phase] = statistics.median(av), statistics.median(bv)
        out_cell.ratio[phase] = statistics.median(ratios) if ratios else float("nan")
        print(f"  {wtype:7} {part:8} t{threads} {phase:7} A {spread(av)}  B {spread(bv)}  "
              f"A/B {spread(ratios)}  CPU B/A {spread(cpu)}  n={len(pairs)}", flush=True)  # fmt: skip
    w = runs["A"][0].weights, runs["B"][0].weights
    print(f"  {wtype:7} {part:8} t{threads} logits A vs B: {', '.join(sorted(set(logits)))}; "
          f"{runs['A'][0].prompt_tokens}-token prompt; weights A {w[0]}, B {w[1]}", flush=True)  # fmt: skip
    return out_cell


def headline(cells: list[Cell], sides: dict[str, Side], who: dict[str, dict[str, Any]]) -> None:
    """The first weight type's cached prefill at the most threads, the other cells beside it."""
    cached = [c for c in cells if c.part == "cached"]
    if not cached:
        return
    top = max((c for c in cached if c.wtype == cached[0].wtype), key=lambda c: c.threads)
    figures: dict[str, float | int | str] = {
        "A prefill tok/s": top.a["prefill"],
        "A decode tok/s": top.a["decode"],
        "B decode tok/s": top.b["decode"],
        "decode A/B": top.ratio["decode"],
    }
    for c in cells:
        if c is not top:
            for phase in PHASES:
                figures[f"{c.wtype} {c.part} t{c.threads} {phase} A/B"] = c.ratio[phase]
    feats = {k: " ".join(f for f in v["features"] if f.startswith(("AVX", "AMX"))) for k, v in
             who.items()}  # fmt: skip
    record(
        "native-build",
        title="llama.cpp built for this CPU",
        what=f"cached prefill tok/s of A ({sides['A'].name}: {feats['A']}), {top.wtype}, "
        f"{top.threads} thread{'s' if top.threads > 1 else ''}",
        ratio=top.ratio["prefill"],
        yardstick=f"B ({sides['B'].name}: {feats['B']})",
        yardstick_value=top.b["prefill"],
        unit="tok/s",
        figures=figures,
        detail=f"decode {top.ratio['decode']:.2f}×; medians of per-pair ratios",
        model=f"planted qwen3moe, {LAYERS[top.wtype]} layers × 64 experts, top-8, hidden 1024, "
        f"{top.wtype}, fully cached",
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument(
        "--a", default="this", help="build A: this (default), portable, a wheel or a Python"
    )
    ap.add_argument("--b", default="portable", help="build B (default: portable)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/moepack-bench-build"))
    ap.add_argument("--types", default="Q4_0,Q8_0,Q4_K_M")
    ap.add_argument("--parts", default="cached,pressure")
    ap.add_argument("--threads", default=f"1,{os.cpu_count() or 1}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per run")
    ap.add_argument("--spin", type=int, default=None,
                    help="GOMP_SPINCOUNT of the runs (default: run's own choice)")  # fmt: skip
    ap.add_argument("--leave", default="1.5G", help="memory the holder leaves (pressure)")
    ap.add_argument("--memory", default="0.6G", help="the pager's budget under pressure")
    ap.add_argument("--hold-floor", type=parse_size, default=parse_size("256M"),
                    help="the holder lets go below this MemAvailable")  # fmt: skip
    ap.add_argument("--drop-models", action="store_true",
                    help="delete each model after its cells (a few GB of disk at a time)")  # fmt: skip
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_run(json.loads(args.one))))
        return 0
    args.dir.mkdir(parents=True, exist_ok=True)
    sides = {"A": resolve(args.a, args.dir), "B": resolve(args.b, args.dir)}
    who = {name: identify(side) for name, side in sides.items()}
    for name, side in sides.items():
        w = who[name]
        print(f"{name}: {side.name}: llama-cpp-python {w['version']} ({w['llama_cpp']}), CPU "
              f"backend {' '.join(w['features'])}; extra buffer types "
              f"{', '.join(w['extra_bufts'])}")  # fmt: skip
    if who["A"]["features"] == who["B"]["features"]:
        print("note: A and B were compiled with the same CPU features", flush=True)
    threads = sorted({int(t) for t in args.threads.split(",")})
    parts = args.parts.split(",")
    print(f"load average {os.getloadavg()[0]:.2f}; {args.rounds} alternated rounds, "
          f"medians (range) of the pairs{' the holder held through' if 'pressure' in parts else ''}",
          flush=True)  # fmt: skip
    cells: list[Cell] = []
    for wtype in args.types.split(","):
        model, prompts = bench_run.ensure_model(LAYERS[wtype], args.dir, "qwen3moe",
                                                weight_type=wtype)  # fmt: skip
        print(f"{model.name}: {model.stat().st_size / 1e9:.2f} GB", flush=True)
        try:
            with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
                for part in parts:
                    for t in threads:
                        c = cell(args, sides, wtype, part, t, model, prompts, Path(scratch))
                        if c is not None:
                            cells.append(c)
        finally:
            if args.drop_models:
                model.unlink()
        print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    headline(cells, sides, who)
    return 0


if __name__ == "__main__":
    sys.exit(main())
