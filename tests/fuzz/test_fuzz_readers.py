"""The quick deterministic pass of moepack's fuzz harness (``harness.py``): every reader, a
few hundred structure-aware and random mutations plus non-regular paths, in a child process
whose address space is capped. ``scripts/fuzz.py`` runs the long pass."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HARNESS = Path(__file__).with_name("harness.py")
QUICK_COUNT = 480  # 40 per reader: about ten seconds here


def test_every_reader_keeps_the_one_line_contract_under_mutation(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(HARNESS), "--count", str(QUICK_COUNT), "--seed", "0",
         "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    failures = result["failures"]
    assert not failures, json.dumps(failures[:5], indent=1)
    assert result["inputs"] == result["runs"] >= QUICK_COUNT
    assert min(result["per_target"].values()) >= QUICK_COUNT // len(result["per_target"])
    assert len(result["per_target"]) == 12  # every reader the issue names


def test_the_harness_catches_what_it_is_for(tmp_path):
    """The verdict is not vacuous: a traceback, two error lines, a hang and a bad exit code
    are each failures."""
    sys.path.insert(0, str(HARNESS.parent))
    import harness

    assert harness.verdict(0, "", None) is None
    assert harness.verdict(2, "moepack: error: x: bad\n", None) is None
    assert harness.verdict(0, "moepack: warning: shape only\n", None) is None
    assert harness.verdict(2, "moepack: error: a\nb\n", None) == "2 stderr lines"
    assert harness.verdict(2, "", None) == "a failure without its one-line error"
    assert harness.verdict(3, "", None) == "exit code 3"
    assert "MemoryError" in (harness.verdict(None, "", "Traceback ...\nMemoryError") or "")
    code, _, _, crash = harness.run_cli(["trace", "info", str(tmp_path / "missing.moetrace")])
    assert code == 2 and crash is None
