#!/usr/bin/env python3
"""The long pass of moepack's fuzz harness: ``scripts/fuzz.py --count N --seed S``.

Runs ``tests/fuzz/harness.py`` in a child process (address space capped, every CLI run under
an alarm): every path argument of every command with every hostile path (llama.cpp's
commands included), then ``N`` mutated inputs spread over every reader, then ``--requests``
hostile requests to ``moepack serve`` on every route of both APIs (``serverfuzz.py``). Prints
the inputs, the runs, the failures by kind (tracebacks, hangs, memory blowups, multi-line
errors, the server's) and each failure with the seed that reproduces it; exits 1 if there was
any. ``--json`` prints
the harness's whole result.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HARNESS = Path(__file__).resolve().parents[1] / "tests" / "fuzz" / "harness.py"


def main() -> int:
    ap = argparse.ArgumentParser(description="moepack's long fuzz pass over every reader")
    ap.add_argument("--count", type=int, default=20_000, help="mutated inputs (default 20,000)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--paths", choices=["all", "quick", "none"], default="all",
                    help="hostile paths in every path argument (default all)")  # fmt: skip
    ap.add_argument("--requests", type=int, default=2_000,
                    help="hostile requests to a served model, every route of every API "
                         "(default 2,000; 0: none)")  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print the whole result as JSON")
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="moepack-fuzz-") as folder:
        proc = subprocess.run(
            [sys.executable, str(HARNESS), "--count", str(ns.count), "--seed", str(ns.seed),
             "--dir", folder, "--paths", ns.paths, "--requests", str(ns.requests)],
            capture_output=True, text=True,
        )  # fmt: skip
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        return 2
    result = json.loads(proc.stdout)
    if ns.json:
        print(json.dumps(result, indent=1))
    failures, kinds = result["failures"], result["kinds"]
    print(
        f"seed {result['seed']}: {result['inputs']:,} inputs, {result['runs']:,} runs through "
        f"the CLI in {result['seconds']} s: {kinds['tracebacks']} tracebacks, {kinds['hangs']} "
        f"hangs, {kinds['blowups']} memory blowups, {kinds['multi_line']} multi-line errors, "
        f"{kinds['other']} other failures (address space capped at "
        f"{result['memory_cap_bytes'] >> 30} GiB); {len(result['per_path'])} of "
        f"{result['path_parameters']} path arguments run, {len(result['uncovered'])} uncovered"
    )
    for name, runs in result["per_target"].items():
        print(f"  {name:13} {runs:7,} runs")
    served = result["served"]
    if served:
        print(
            f"served: {served['requests']:,} requests in {served['seconds']} s, "
            f"{kinds['server']} failures (a 5xx, an answer out of its API's shape, past its "
            "max_tokens or with the server's insides, no answer, a worker that died)"
        )
        for name, n in served["per_route"].items():
            print(f"  {name:27} {n:6,} requests")
        for name, n in served["per_family"].items():
            print(f"  {name:27} {n:6,} requests")
    for name in result["uncovered"]:
        print(f"UNCOVERED {name}: no command line in tests/fuzz/commands.py fills it")
    for f in failures:
        print(f"FAIL {f['target']} {f['mutation']} seed {f['seed']}: {f['kind']}: {f['why']}")
        print(f"     moepack {' '.join(map(repr, f['args']))}")
    return 1 if failures or result["uncovered"] else 0


if __name__ == "__main__":
    sys.exit(main())
