"""The interrupt stress harness (scripts/stress_interrupts.py), a few instants per command.

Seeded delays; every outcome the signal can produce is checked for what it must be (old or
new, one honest line, inputs untouched, no temporary after the next run), so the test holds
wherever the signal lands. The long run is the script itself with ``--trials 200``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "stress_interrupts.py"


def load_harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("stress_interrupts", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("command", ["repack", "convert", "synth", "npu-pack"])
def test_interrupts_and_kills_leave_old_or_new(tmp_path: Path, command: str) -> None:
    harness = load_harness()
    assert harness.run_all(tmp_path, trials=3, seed=11, only={command}) == []
