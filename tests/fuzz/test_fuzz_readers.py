"""The quick deterministic pass of moepack's fuzz harness (``harness.py``): every reader, a
few hundred structure-aware and random mutations, ``fit URL`` against misbehaving HTTP
servers, and every path argument of every command with each hostile path it refuses quickly, in a child process whose address space is capped.
``scripts/fuzz.py`` runs the long pass (all hostile paths, llama.cpp's commands included)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HARNESS = Path(__file__).with_name("harness.py")
QUICK_COUNT = 420  # 20 per reader: about a minute here, with the path pass
ORIGINAL_READERS = {"gguf", "moetrace", "pmxtrace", "text", "routecsv", "moeplan", "pmxplan",
                    "surface", "surface-peer", "q4nx", "npu-dump", "txn"}  # fmt: skip
SECOND_PASS_READERS = {"repacked", "mblt", "store", "moeprec", "names", "prompts",
                       "dropin-text", "config", "manifest"}  # fmt: skip
SERVERS = {"http-server"}  # fit URL against misbehaving HTTP servers


def test_every_reader_and_path_argument_keeps_the_one_line_contract(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(HARNESS), "--count", str(QUICK_COUNT), "--seed", "0",
         "--dir", str(tmp_path), "--paths", "quick"],
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    failures = result["failures"]
    assert not failures, json.dumps(failures[:5], indent=1)
    assert result["inputs"] == result["runs"] >= QUICK_COUNT
    per_target = result["per_target"]
    assert set(per_target) == ORIGINAL_READERS | SECOND_PASS_READERS | SERVERS  # every reader
    assert min(per_target.values()) >= QUICK_COUNT // len(per_target)
    assert result["uncovered"] == []  # every path argument of every command has a template
    assert len(result["per_path"]) == result["path_parameters"]  # and was run
    assert min(result["per_path"].values()) >= 6


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
    assert (harness.verdict(0, "moepack: warning: a\nb\n", None) or "").startswith("2 stderr")
    assert harness.verdict(0, "warning: no prefix\n", None) is not None  # every line says moepack
    assert "MemoryError" in (harness.verdict(None, "", "Traceback ...\nMemoryError") or "")
    assert harness.classify("MemoryError") == "blowups"
    assert harness.classify("no result after 20 s (blocked or unbounded)") == "hangs"
    assert harness.classify("2 stderr lines") == "multi_line"
    assert harness.classify("2 stderr lines (a stray line beside the warnings)") == "multi_line"
    assert harness.classify("RuntimeError: Symlink loop") == "tracebacks"
    code, _, _, crash = harness.run_cli(["trace", "info", str(tmp_path / "missing.moetrace")])
    assert code == 2 and crash is None


def test_a_new_path_option_without_a_template_is_reported():
    """The harness lists every path parameter from the CLI itself: one no template fills is
    named, so a command added later cannot escape the harness unnoticed."""
    sys.path.insert(0, str(HARNESS.parent))
    import commands

    saved = commands.TEMPLATES.pop("store info")
    try:
        assert commands.uncovered() == ["store info store"]
    finally:
        commands.TEMPLATES["store info"] = saved
    assert commands.uncovered() == []
