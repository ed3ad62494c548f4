#!/usr/bin/env python3
"""The long pass of moepack's fuzz harness: ``scripts/fuzz.py --count N --seed S``.

Runs ``tests/fuzz/harness.py`` in a child process (address space capped, every CLI run under
an alarm), prints how many inputs and runs it made and every failure with the seed that
reproduces it, and exits 1 if there was any. ``--json`` prints the harness's whole result.
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
    ap.add_argument("--json", action="store_true", help="print the whole result as JSON")
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="moepack-fuzz-") as folder:
        proc = subprocess.run(
            [sys.executable, str(HARNESS), "--count", str(ns.count), "--seed", str(ns.seed),
             "--dir", folder],
            capture_output=True, text=True,
        )  # fmt: skip
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        return 2
    result = json.loads(proc.stdout)
    if ns.json:
        print(json.dumps(result, indent=1))
    failures = result["failures"]
    print(
        f"seed {result['seed']}: {result['inputs']:,} inputs, {result['runs']:,} runs through "
        f"the CLI, {len(failures)} failures in {result['seconds']} s "
        f"(address space capped at {result['memory_cap_bytes'] >> 30} GiB)"
    )
    for name, runs in result["per_target"].items():
        print(f"  {name:13} {runs:7,} runs")
    for f in failures:
        print(f"FAIL {f['target']} {f['mutation']} seed {f['seed']}: {f['why']}")
        print(f"     moepack {' '.join(f['args'])}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
