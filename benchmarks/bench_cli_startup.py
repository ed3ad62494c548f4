"""Start-up of the command line against the imports it cannot avoid, measured in the same run.

  * ``moepack --help`` and ``moepack engines`` / ``python -c "import click"`` (target: 1.5x);
  * ``moepack inspect SMALL.gguf`` / ``python -c "import numpy, gguf"`` (target: 1.3x), on a
    small model this script writes with ``moepack synth``.

Every process is started ``--repeat`` times; the commands take turns (the order rotates each
round, so none always runs after the same one); each time is the median of its runs and each
ratio the median of the rounds' ratios. The
modules each command imports are counted once with ``python -X importtime``. Bytecode is
cached (in a temporary ``PYTHONPYCACHEPREFIX``, for every module alike), as it is for an
installed package; without it each run would compile moepack's sources again. Two more rows
are floors, not targets: what click and rich (which every command renders with) cost on top
of each yardstick. Run it on a calm machine (load average well under the number of cores).

    .venv/bin/python benchmarks/bench_cli_startup.py [--repeat 15] [--dir DIR]
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
RENDER = "click, rich.console, rich.table"  # what every command's output needs
SCRIPT = Path(PY).with_name("moepack")  # the installed command, as people run it


def moepack(*args: str) -> list[str]:
    """``moepack ARGS``: the console script beside this Python, else its two lines."""
    if SCRIPT.exists():
        return [PY, str(SCRIPT), *args]
    return [PY, "-c", "import sys; from moepack.entry import main; main()", *args]


ENV = dict(os.environ)


def run(argv: list[str], check: bool = False) -> float:
    """Wall time of one process, start to exit."""
    t = time.perf_counter()
    p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, env=ENV)
    seconds = time.perf_counter() - t
    if check and p.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.decode()[-500:]}")
    return seconds


def modules_imported(argv: list[str]) -> tuple[int, int]:
    """How many modules the process imports, all and moepack's (``-X importtime``)."""
    p = subprocess.run(
        [argv[0], "-X", "importtime", *argv[1:]],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=ENV,
    )
    names = [
        line.rsplit("|", 1)[1].strip()
        for line in p.stderr.splitlines()
        if line.startswith("import time:") and not line.endswith("| imported package")
    ]
    return len(names), sum(1 for n in names if n == "moepack" or n.startswith("moepack."))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15, help="runs of each command")
    ap.add_argument("--dir", type=Path, default=None, help="where the small model goes")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-cli-", dir=args.dir))
    ENV.pop("PYTHONDONTWRITEBYTECODE", None)
    ENV["PYTHONPYCACHEPREFIX"] = str(folder / "pycache")
    try:
        small = folder / "small.gguf"
        small_args = ["--layers", "2", "--experts", "8", "--top-k", "2", "--hidden", "64"]
        small_args += ["--expert-ffn", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "32"]
        small_args += ["--vocab", "262"]
        run(moepack("synth", "--out", str(small), *small_args, "-q"), check=True)
        commands = {
            "import click": [PY, "-c", "import click"],
            "moepack --help": moepack("--help"),
            "moepack engines": moepack("engines"),
            "import numpy, gguf": [PY, "-c", "import numpy, gguf"],
            "moepack inspect": moepack("inspect", str(small)),
            "+ click, rich": [PY, "-c", f"import {RENDER}"],
            "+ numpy, gguf": [PY, "-c", f"import numpy, gguf, {RENDER}"],
        }
        for argv in commands.values():  # each once before timing: caches warm, and it works
            run(argv, check=True)
        load_before = os.getloadavg()
        times: dict[str, list[float]] = {name: [] for name in commands}
        names = list(commands)
        for r in range(args.repeat):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name].append(run(commands[name]))
        load_after = os.getloadavg()
        median = {name: statistics.median(ts) for name, ts in times.items()}
        counted = {name: modules_imported(argv) for name, argv in commands.items()}

        print(
            f"{small.name}: {small.stat().st_size:,} B; {args.repeat} runs each, alternating; "
            f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after "
            f"({os.cpu_count()} cores)"
        )
        print(f"command: {' '.join(moepack())}\n")
        header = f"{'command':<18} {'median s':>9} {'modules':>8} {'moepack':>8}   ratio   target"
        print(header)
        print("-" * len(header))
        pairs = [
            ("import click", None, None),
            ("moepack --help", "import click", 1.5),
            ("moepack engines", "import click", 1.5),
            ("import numpy, gguf", None, None),
            ("moepack inspect", "import numpy, gguf", 1.3),
            ("+ click, rich", "import click", None),
            ("+ numpy, gguf", "import numpy, gguf", None),
        ]
        met_all = True
        ratios: dict[str, float] = {}
        for name, yardstick, target in pairs:
            total, ours = counted[name]
            line = f"{name:<18} {median[name]:>9.3f} {total:>8} {ours:>8}"
            if yardstick is not None:
                # the median of each round's ratio: a slow spell of the machine hits both
                ratio = statistics.median(
                    a / b for a, b in zip(times[name], times[yardstick], strict=True)
                )
                line += f"   {ratio:5.2f}x  "
                ratios[name] = ratio
                if target is None:
                    line += f"floor over {yardstick!r}"
                else:
                    met = ratio <= target
                    met_all &= met
                    line += f"{target}x of {yardstick!r}: {'met' if met else 'NOT met'}"
            print(line)
        spread = {n: (min(ts), max(ts)) for n, ts in times.items()}
        print(
            "\nrange of the runs (s): "
            + "; ".join(f"{n} {a:.3f}-{b:.3f}" for n, (a, b) in spread.items())
        )
        print("all targets met" if met_all else "some targets not met")
        record(
            "cli-startup",
            title="Command line start-up",
            what="`moepack --help`, wall time",
            ratio=ratios["moepack --help"],
            yardstick='`python -c "import click"`',
            yardstick_value=median["import click"],
            unit="s",
            figures={f"{n} s": median[n] for n in commands}
            | {f"{n} / {y}": ratios[n] for n, y, _ in pairs if y is not None},
            target="`--help` and `engines` ≤ 1.5× `import click`, `inspect` ≤ 1.3× `import "
            "numpy, gguf` (issue 18)",
            met=met_all,
            target_value=", ".join(f"{ratios[n]:.2f}×" for n, _, t in pairs if t is not None),
            detail=f"`engines` {ratios['moepack engines']:.2f}× (rich's console and table alone "
            f"take {ratios['+ click, rich']:.2f}×), `inspect` {ratios['moepack inspect']:.2f}×",
            model=f"`moepack inspect` on a {small.stat().st_size / 1024:.0f} KiB `moepack synth` "
            f"model; {args.repeat} runs each",
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
