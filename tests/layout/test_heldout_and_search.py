"""Held out by whole prompts, plan --search at queue depth > 1, read-through gaps in the
planner's objective."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moefixtures import run_cli, synth_with_trace
from moepack.errors import BadInput
from moepack.layout.heldout import split_held_out
from moepack.layout.planner import order_cost
from moepack.trace import load_trace, save_trace, synth_trace


def test_held_out_split_keeps_prompts_whole_and_falls_back_to_tokens() -> None:
    trace = synth_trace(tokens=100, layers=1, n_expert=8, top_k=2, seed=0)
    by_tokens = split_held_out(trace, 0.25)
    assert by_tokens.by == "tokens" and by_tokens.held_range == (75, 100)
    segments = [(0, 30, 10), (40, 20, 0), (60, 10, 10), (80, 15, 5)]
    captured = trace.replace(prefill_tokens=0, segments=segments)
    split = split_held_out(captured, 0.25)
    # the split lands on a prompt boundary, never inside a prompt
    assert split.by == "prompts" and split.held_range == (80, 100)
    assert (split.train_prompts, split.held_prompts) == (3, 1)
    most = split_held_out(captured, 0.9)  # at least one prompt stays for training
    assert most.train_prompts == 1 and most.held_range == (40, 100)
    with pytest.raises(BadInput, match="between 0 and 1"):
        split_held_out(captured, 1.0)


def test_gaps_read_through_make_near_neighbours_one_request() -> None:
    tab = np.array([0.0, 1.0, 1.2, 1.4, 1.6])  # a request spanning L slots
    ids = np.array([[0, 2]])
    slot_of = np.arange(4)
    assert order_cost(ids, slot_of, tab) == 2.0  # slots 0 and 2: two requests
    assert order_cost(ids, slot_of, tab, gap=1) == pytest.approx(1.4)  # one spanning 3 slots


@pytest.fixture
def prompts_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, Path]:
    model, trace = synth_with_trace(capsys, tmp_path, "--layers", "2", "--tokens", "800")
    t = load_trace(trace)
    segments = [(200 * i, 150, 50) for i in range(4)]
    captured = t.replace(prefill_tokens=0, segments=segments)
    out = tmp_path / "prompts.moetrace"
    save_trace(captured, out)
    return model, out


def test_plan_search_holds_out_whole_prompts_at_a_deeper_queue(
    prompts_pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, trace = prompts_pair
    out = tmp_path / "p.moeplan"
    args = ["plan", model, "--trace", trace, "--out", out, "--search", "--holdout", "0.3"]
    args.append("--force")  # each run below replaces the plan the one before wrote
    code, stdout, err = run_cli(
        capsys, *args, "--engine", "threads", "--qd", "4", "--merge-gap", "1", "--json"
    )
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["held_out"]["by"] == "prompts" and doc["held_out_tokens"] == [600, 800]
    assert doc["queue_depth"] == 4 and doc["engine"] == "threads" and doc["merge_gap"] == 1
    assert doc["gap"] == pytest.approx(doc["train_gain"] - doc["held_out_gain"])
    code, stdout, err = run_cli(capsys, *args)
    assert code == 0, err
    assert "judged on the 1 held-out prompts" in stdout
    code, _, err = run_cli(capsys, *args, "--engine", "pread", "--qd", "4")
    assert code == 2 and "queue depth 1 only" in err and len(err.strip().splitlines()) == 1


def test_analyse_holdout_reports_the_rest_and_the_gap(
    prompts_pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model, trace = prompts_pair
    code, out, err = run_cli(capsys, "analyse", model, trace, "--holdout", "0.25", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["held_out"]["by"] == "prompts" and doc["tokens"] == [600, 800]
    em = doc["summary"]["expert-major"]
    assert em["train_speedup"] > 1.0
    assert em["gap"] == pytest.approx(em["train_speedup"] - em["speedup"])
    code, _, err = run_cli(capsys, "analyse", model, trace, "--holdout", "0.25", "--tokens", "1:")
    assert code == 2 and "not both" in err


def test_plain_plan_holds_out_whole_prompts(
    prompts_pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, trace = prompts_pair
    out = tmp_path / "p.moeplan"
    args = ["plan", model, "--trace", trace, "--out", out, "--holdout", "0.25", "--force"]
    code, stdout, err = run_cli(capsys, *args, "--json")
    assert code == 0, err
    h = json.loads(stdout)["held_out"]
    assert h["by"] == "prompts" and h["held_out_tokens"] == [600, 800]
    assert h["requests_after"] <= h["requests_before"]
    assert h["gap"] == pytest.approx(h["train_gain"] - h["held_out_gain"])
    code, stdout, err = run_cli(capsys, *args)
    assert code == 0 and "on the 1 held-out prompts" in stdout
