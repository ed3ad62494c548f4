"""``moepack demo`` with llama.cpp: real routing captured, a plan scored on held-out prompts,
the repack judged by llama.cpp's logits and by its routing mapped back."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moefixtures import run_cli
from moepack.checkpoint import MoeModel
from moepack.layout.heldout import requests_per_token, split_by_prompts
from moepack.layout.plan import load_plan
from moepack.llama.runtime.capture import token_prompts
from moepack.trace import load_trace
from moepack.trace.routing_map import routing_maps_back

pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
pytestmark = pytest.mark.slow


def test_demo_closes_the_loop_on_captured_routing(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("MOEPACK_DEMO_NO_LLAMA", raising=False)
    d = tmp_path / "demo"
    code, out, err = run_cli(capsys, "demo", "--dir", d, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["trace_source"] == "captured" and doc["prompt_count"] == 16
    assert sorted(p.name for p in d.iterdir()) == [
        ".moepack-demo",
        "model-repacked.gguf",
        "model-repacked.moetrace",
        "model.gguf",
        "model.moeplan",
        "model.moetrace",
        "model.prompts.jsonl",
    ]
    held = doc["held_out"]
    assert held["train_prompts"] == 12 and held["held_out_prompts"] == 4
    assert held["train_tokens"] + held["held_out_tokens"] == doc["trace_tokens"]
    assert doc["plan_tokens"] == held["train_tokens"]
    # planted clusters of top-k experts: the plan cuts requests on prompts it never saw
    assert held["requests_per_token_after"] < 0.5 * held["requests_per_token_before"]
    assert doc["verified"]["ok"] and doc["judge"]["argmax_agreement"] == 1.0
    assert doc["judge"]["max_abs_diff"] <= doc["judge"]["tolerance"]
    assert doc["routing"] == {
        "tokens": doc["trace_tokens"],
        "cells": 4 * doc["trace_tokens"],
        "same_set": 1.0,
        "same_order": 1.0,
        "ok": True,
    }

    # the held-out figure is recomputed from the files: only prompts 13-16, the saved plan
    with MoeModel(d / "model.gguf") as m:
        trace = load_trace(d / "model.moetrace", model=m)
        split = split_by_prompts(trace, 12)
        assert set(token_prompts(trace)[trace.tokens - split.held_out.tokens :]) == {
            12,
            13,
            14,
            15,
        }
        before, after = requests_per_token(m, split.held_out, load_plan(d / "model.moeplan"))
    assert (before, after) == pytest.approx(
        (held["requests_per_token_before"], held["requests_per_token_after"])
    )
    # the gate can fail: the repack's routing read without its permutation does not match
    with MoeModel(d / "model-repacked.gguf") as m:
        repacked = load_trace(d / "model-repacked.moetrace", model=m)
    assert not np.array_equal(np.asarray(repacked.ids), np.asarray(trace.ids))
    wrong = routing_maps_back(trace, trace, d / "model-repacked.gguf")
    assert not wrong.ok and wrong.same_set < 1.0

    # human form: one line per step, the held-out numbers in the plan line
    code, out, err = run_cli(capsys, "demo", "--dir", d, "-q")
    assert code == 0, err
    lines = out.splitlines()
    assert [ln.split()[1] for ln in lines] == [
        "synth",
        "capture",
        "plan",
        "repack",
        "verify",
        "llama.cpp",
    ], out
    assert "held-out" in lines[2] and "100 % as sets, 100 % in order" in lines[5]
