"""What building the prefetcher's C once saves each process, measured in the same run.

Before, every process that ran llama.cpp with the prefetcher compiled its two C helpers (the
eval gate and the read-ahead thread) into a temporary folder. Now they are built once per
source, flags and compiler into the cache directory and loaded from there. Three yardsticks,
each in fresh processes, taking turns each round:

  * loading both libraries with an empty cache (what every process paid before) against a
    warm cache, and against ``python -c "import ctypes"`` (the floor);
  * ``moepack run --prefetch`` on a small generated model with an empty cache against a warm
    one: the seconds saved per run and the ratio of wall times.

    .venv/bin/python benchmarks/bench_cbuild.py [--repeat 7] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from headline import record

PY = sys.executable
SCRIPT = Path(PY).with_name("moepack")
LOAD = (
    "from moepack.llama.prefetcher.evalgate import compile_gate\n"
    "from moepack.llama.prefetcher.native import native_library\n"
    "assert compile_gate() is not None and native_library() is not None\n"
)


def moepack(*args: str) -> list[str]:
    if SCRIPT.exists():
        return [PY, str(SCRIPT), *args]
    return [PY, "-c", "import sys; from moepack.entry import main; main()", *args]


def timed(argv: list[str], cache: Path) -> float:
    """Wall seconds of one process with ``cache`` as moepack's cache directory."""
    env = {**os.environ, "MOEPACK_CACHE_DIR": str(cache)}
    env.pop("MOEPACK_NO_C_GATE", None)
    t = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, stdin=subprocess.DEVNULL)
    seconds = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.decode()[-800:]}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7, help="rounds")
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder (model, caches)")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-cbuild-", dir=args.dir))
    try:
        model = folder / "m.gguf"
        synth = ["synth", "--out", str(model), "--layers", "4", "--experts", "16", "--top-k", "4"]
        subprocess.run(moepack(*synth, "-q"), check=True, capture_output=True)
        warm = folder / "warm"
        run = moepack("run", str(model), "-p", "hello", "-n", "4", "--prefetch")
        commands = {
            "import ctypes": [PY, "-c", "import ctypes"],
            "load, empty cache": [PY, "-c", LOAD],
            "load, warm cache": [PY, "-c", LOAD],
            "run, empty cache": run,
            "run, warm cache": run,
        }
        timed(run, warm)  # builds into the warm cache, and checks that run works
        times: dict[str, list[float]] = {name: [] for name in commands}
        names = list(commands)
        for r in range(args.repeat):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                cache = warm if "warm" in name else folder / f"empty-{r}-{len(times[name])}"
                times[name].append(timed(commands[name], cache))
                if "empty" in name:
                    shutil.rmtree(cache, ignore_errors=True)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        print(
            f"{args.repeat} rounds, fresh processes, turns rotated; {os.cpu_count()} cores, "
            f"load average {os.getloadavg()[0]:.2f}; compiler {shutil.which('cc')}"
        )
        print(f"{'process':<20} {'median s':>9} {'min s':>8} {'max s':>8}")
        for name, ts in times.items():
            print(f"{name:<20} {med[name]:>9.3f} {min(ts):>8.3f} {max(ts):>8.3f}")
        floor = med["import ctypes"]
        saved_load = med["load, empty cache"] - med["load, warm cache"]
        saved_run = med["run, empty cache"] - med["run, warm cache"]
        print()
        print(
            f"loading the C, warm / empty cache: {med['load, warm cache'] / med['load, empty cache']:.3f}"
            f" ({saved_load:.3f} s saved; warm cache {med['load, warm cache'] / floor:.2f}x "
            f"import ctypes)"
        )
        print(
            f"moepack run --prefetch, warm / empty cache: "
            f"{med['run, warm cache'] / med['run, empty cache']:.3f} ({saved_run:.3f} s saved per run)"
        )
        record(
            "cbuild",
            title="Prefetcher's C built once",
            what="`moepack run --prefetch` (4 tokens) with the C already built, wall time",
            ratio=med["run, warm cache"] / med["run, empty cache"],
            yardstick="the same with an empty cache, compiling in the process as before",
            yardstick_value=med["run, empty cache"],
            unit="s",
            figures={f"{name} s": m for name, m in med.items()} | {"saved per run s": saved_run},
            detail=f"{saved_run:.2f} s saved per run",
            model="a 4-layer, 16-expert `moepack synth` model",
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
