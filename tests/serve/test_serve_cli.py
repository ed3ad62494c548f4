"""``moepack serve``'s command line before any server starts: the same prefetch flags as
``run``, the help saying what tracing costs, and bad input as one line, exit 2."""

from __future__ import annotations

import numpy as np
import pytest

from moefixtures import run_cli, tiny_spec, write_gguf
from moepack.checkpoint.synth import synth_model
from moepack.cli.registry import COMMANDS
from moepack.trace import RoutingTrace, save_trace


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synth_model(tmp_path_factory.mktemp("cli") / "m.gguf", tiny_spec()).paths[0]


def _flags(capsys, command: str) -> set[str]:
    code, out, _ = run_cli(capsys, command, "--help")
    assert code == 0
    return {w.rstrip(",") for w in out.split() if w.startswith("--")}


def test_serve_takes_runs_prefetch_flags_and_says_what_tracing_costs(capsys):
    prefetch = {"--prefetch", "--prefetch-mode", "--lookahead", "--lookahead-budget",
                "--lookahead-depth", "--lookahead-trace", "--pin-dense", "--cache", "--engine",
                "--qd"}  # fmt: skip
    assert prefetch <= _flags(capsys, "run")
    assert prefetch <= _flags(capsys, "serve")
    code, out, _ = run_cli(capsys, "serve", "--help")
    assert "logits_all=True" in " ".join(out.split())
    assert "serve" in COMMANDS


def test_bad_input_is_one_line_before_any_server_starts(model, tmp_path, capsys):
    dense = write_gguf(tmp_path / "dense.gguf", "llama", {"token_embd.weight": (8, 4)})
    existing = tmp_path / "existing.moetrace"
    three = tmp_path / "three.moetrace"  # three layers for a model of two
    save_trace(RoutingTrace(ids=np.tile(np.array([0, 1], np.uint8), (4, 3, 1)), n_expert=8), three)
    wide = tmp_path / "wide.moetrace"  # expert 9 of a model with 8
    save_trace(RoutingTrace(ids=np.tile(np.array([1, 9], np.uint8), (4, 2, 1)), n_expert=16), wide)
    existing.write_bytes(three.read_bytes())
    kept = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    cases = [
        ([tmp_path / "none.gguf"], "no such file"),
        ([dense], "not a MoE model"),
        ([model, "--trace-out", tmp_path / "t.unknown"], "t.unknown"),
        ([model, "--trace-out", model], "overwrite"),
        ([model, "--trace-out", tmp_path / "no" / "t.moetrace"], "does not exist"),
        ([model, "--prefetch", "--engine", "nope"], "nope"),
        ([model, "--prefetch", "--lookahead-trace", tmp_path / "none.moetrace"], "no such"),
        ([model, "--prefetch", "--lookahead-trace", three], "of 3 layers"),
        (
            [model, "--prefetch", "--lookahead-trace", wide],
            "16 experts per layer for a model with 8",
        ),
        ([model, "--prefetch", "--lookahead-trace", tmp_path], "is a directory"),
        ([model, "--trace-out", existing], "already exists"),
        ([model, "--alias", " "], "--alias"),
        ([model, "--port", "70000"], "70000"),
    ]
    for args, words in cases:
        code, out, err = run_cli(capsys, "serve", *args)
        assert code == 2, (args, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("moepack: error: "), (args, err)
        assert words in lines[0], (args, lines[0])
        assert out == ""
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == kept  # nothing written
