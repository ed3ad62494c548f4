"""The first planner, `moepack synth` with a trace, and the end-to-end demo."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moefixtures import run_cli, synth_with_trace, tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.synth import synth_model
from moepack.demo import NO_LLAMA_ENV, run_demo
from moepack.errors import BadInput
from moepack.layout.coactivation_plan import plan_from_trace
from moepack.layout.heldout import split_by_prompts
from moepack.layout.plan import load_plan
from moepack.rewrite.repack import repack
from moepack.rewrite.verify import verify
from moepack.trace import coactivation, expert_counts, load_trace, synth_trace
from moepack.trace.chain import greedy_chain, runs_per_token
from moepack.trace.synth import TraceStructure, synth_truth


def test_runs_per_token_counts_contiguous_runs():
    ids = np.array([[0, 1, 2], [0, 2, 4], [5, 3, 4]])
    assert runs_per_token(ids, np.arange(6)) == pytest.approx((1 + 3 + 1) / 3)
    slot_of = np.array([0, 5, 1, 3, 2, 4])  # expert 2 -> slot 1, expert 4 -> slot 2
    assert runs_per_token(ids, slot_of) == pytest.approx((2 + 1 + 1) / 3)


def test_greedy_chain_puts_planted_clusters_together():
    n, k, C = 64, 4, 8
    trace = synth_trace(
        tokens=6000,
        layers=1,
        n_expert=n,
        top_k=k,
        structure=TraceStructure(
            clusters=C, locality=1.0, persistence=0.0, cluster_persistence=0.0
        ),
        seed=3,
    )
    planted = synth_truth(trace)
    assert planted is not None
    truth = np.asarray(planted.cluster_of[0])
    perm = greedy_chain(coactivation(trace, 0), expert_counts(trace)[0], window=k)
    assert sorted(perm.tolist()) == list(range(n))
    # every planted cluster ends up as one contiguous run of slots
    assert int(np.count_nonzero(np.diff(truth[perm]))) == C - 1
    slot_of = np.empty(n, dtype=np.int64)
    slot_of[perm] = np.arange(n)
    ids = np.asarray(trace.ids[:, 0, :])
    truth_order = np.empty(n, dtype=np.int64)
    truth_order[np.argsort(truth, kind="stable")] = np.arange(n)
    planned, identity = runs_per_token(ids, slot_of), runs_per_token(ids, np.arange(n))
    assert planned <= runs_per_token(ids, truth_order) + 0.05
    assert planned < 0.7 * identity


def test_plan_never_worse_than_the_checkpoint_order(tmp_path):
    model_path = synth_model(tmp_path / "m.gguf", tiny_spec(layers=3, experts=16, top_k=4)).paths[0]
    m = MoeModel(model_path)
    outcome = plan_from_trace(m, synth_trace(m, tokens=3000, seed=2))
    for layer in outcome.layers:
        assert layer.requests_after <= layer.requests_before
        if layer.changed:
            assert layer.requests_after < layer.requests_before
    # a trace without structure: keep the identity (never reorder for nothing)
    uniform = synth_trace(
        m,
        tokens=3000,
        seed=2,
        structure=TraceStructure(
            locality=0.0, persistence=0.0, layer_coupling=0.0, cluster_persistence=0.0
        ),
    )
    for lp in plan_from_trace(m, uniform).plan.layers:
        assert lp.requests_after is not None and lp.requests_before is not None
        assert lp.requests_after <= lp.requests_before
    res = repack(model_path, outcome.plan, tmp_path / "r.gguf")
    assert verify(model_path, res.outputs[0]).ok


def test_plan_refuses_a_trace_for_another_model(tmp_path):
    a = synth_model(tmp_path / "a.gguf", tiny_spec()).paths[0]
    b = synth_model(tmp_path / "b.gguf", tiny_spec(seed=5)).paths[0]
    trace = synth_trace(MoeModel(a), tokens=100)
    with pytest.raises(BadInput, match="fingerprint"):
        plan_from_trace(MoeModel(b), trace)


def test_cli_synth_plan_repack_verify(capsys, tmp_path):
    model, trace = tmp_path / "m.gguf", tmp_path / "m.pmxtrace"
    code, out, _ = run_cli(
        capsys,
        "synth",
        "--out",
        str(model),
        "--trace-out",
        str(trace),
        "--experts",
        "16",
        "--top-k",
        "4",
        "--tokens",
        "2000",
        "--prefill",
        "100",
        "--json",
    )
    assert code == 0 and json.loads(out)["trace"] == str(trace)
    t = load_trace(
        trace, model=MoeModel(model)
    )  # the peer format carries no fingerprint: still fits
    assert t.tokens == 2000 and t.prefill_tokens == 100 and t.n_expert == 16
    code, out, _ = run_cli(
        capsys,
        "plan",
        str(model),
        "--trace",
        str(trace),
        "--out",
        str(tmp_path / "p.pmxplan"),
        "--json",
    )
    assert code == 0
    doc = json.loads(out)
    assert doc["plan"]["model_fingerprint"] == MoeModel(model).fingerprint
    assert (tmp_path / "p.pmxplan").read_text().startswith("pmxplan 1")
    assert len(load_plan(tmp_path / "p.pmxplan").layers) == 2
    code, _, _ = run_cli(
        capsys,
        "repack",
        str(model),
        "--plan",
        str(tmp_path / "p.pmxplan"),
        "--out",
        str(tmp_path / "r.gguf"),
        "-q",
    )
    assert code == 0
    code, out, _ = run_cli(
        capsys,
        "verify",
        str(model),
        str(tmp_path / "r.gguf"),
        "--plan",
        str(tmp_path / "p.pmxplan"),
    )
    assert code == 0 and "OK" in out


def test_demo_end_to_end(capsys, tmp_path):
    code, out, err = run_cli(
        capsys, "demo", "--dir", str(tmp_path / "demo"), "--no-llama", "--json"
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc["trace_source"] == "synthetic" and doc["judge"] is None and doc["routing"] is None
    assert doc["verified"]["ok"] and doc["repacked"]["tensors_permuted"] == 16
    assert doc["requests_per_token_after"] <= doc["requests_per_token_before"]
    assert doc["held_out"] is None and doc["trace_tokens"] == 4096
    assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == [
        ".moepack-demo",
        "model-repacked.gguf",
        "model.gguf",
        "model.moeplan",
        "model.moetrace",
    ]
    # again in the same folder: its own files are replaced
    code, _, err = run_cli(capsys, "demo", "--dir", str(tmp_path / "demo"), "--no-llama", "-q")
    assert code == 0, err


def test_demo_without_llama_says_its_trace_is_synthetic(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(NO_LLAMA_ENV, "1")  # the no-llama path even where llama.cpp is installed
    code, out, err = run_cli(capsys, "demo", "--dir", str(tmp_path / "demo"))
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 5 and "synthetic trace" in lines[0], out
    assert "llama.cpp not used" in lines[-1]
    r = run_demo(tmp_path / "lib", use_llama=False)
    assert r.trace_source == "synthetic" and r.verified.ok and r.routing is None


def test_demo_never_overwrites_a_users_folder(capsys, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "model.gguf").write_bytes(b"my precious model")
    code, _, err = run_cli(capsys, "demo", "--dir", str(mine), "--no-llama")
    assert code == 2 and "not made by moepack demo" in err
    assert (mine / "model.gguf").read_bytes() == b"my precious model"
    assert sorted(p.name for p in mine.iterdir()) == ["model.gguf"]


def test_plan_draws_a_coactivation_map(capsys, tmp_path):
    import matplotlib.image

    model, trace = synth_with_trace(capsys, tmp_path)
    code, out, err = run_cli(
        capsys,
        "plan",
        model,
        "--trace",
        trace,
        "--out",
        tmp_path / "p.moeplan",
        "--map",
        tmp_path / "map.png",
        "--json",
    )
    assert code == 0, err
    assert json.loads(out)["map_block"] in (0, 1)
    img = matplotlib.image.imread(tmp_path / "map.png")
    assert img.ndim == 3 and img.shape[1] > img.shape[0] > 200  # two maps side by side
    code, _, err = run_cli(
        capsys,
        "plan",
        model,
        "--trace",
        trace,
        "--out",
        tmp_path / "q.moeplan",
        "--map",
        tmp_path / "x.png",
        "--map-block",
        "7",
    )
    assert code == 2 and "block 7" in err
    assert not (tmp_path / "x.png").exists()
    code, _, err = run_cli(
        capsys, "plan", model, "--trace", trace, "--out", tmp_path / "r.moeplan", "--map", model
    )
    assert code == 2 and "overwrite the input" in err


def test_plan_with_a_block_map_for_a_partial_trace(capsys, tmp_path):
    model, full = synth_with_trace(capsys, tmp_path, "--layers", "3")
    trace = load_trace(full)
    from moepack.trace import RoutingTrace, save_trace

    part = RoutingTrace(
        np.asarray(trace.ids[:, 1:, :]).copy(), trace.n_expert
    )  # blocks 1-2, unlabelled
    save_trace(part, tmp_path / "part.pmxtrace")
    code, _, err = run_cli(
        capsys,
        "plan",
        model,
        "--trace",
        tmp_path / "part.pmxtrace",
        "--out",
        tmp_path / "p.moeplan",
    )
    assert code == 2 and "--block-map" in err
    code, out, err = run_cli(
        capsys,
        "plan",
        model,
        "--trace",
        tmp_path / "part.pmxtrace",
        "--out",
        tmp_path / "p.moeplan",
        "--block-map",
        "1-2",
        "--json",
    )
    assert code == 0, err
    assert [lp["block"] for lp in json.loads(out)["plan"]["layers"]] == [1, 2]


def test_held_out_split_needs_captured_prompts():
    trace = synth_trace(tokens=64, layers=1, n_expert=8, top_k=2, seed=0)
    with pytest.raises(BadInput, match="records a single prompt, no prompts to split by"):
        split_by_prompts(trace, 1)
    segments = [(16 * i, 12, 4) for i in range(4)]
    captured = trace.replace(prefill_tokens=0, segments=segments)
    split = split_by_prompts(captured, 3)
    assert (split.train.tokens, split.held_out.tokens, split.held_out_prompts) == (48, 16, 1)
    assert np.array_equal(split.held_out.ids, trace.ids[48:])
    assert split.train.prompts == 3 and split.train.decode_tokens == 12
    assert split.held_out.prompt_segments == [(0, 12, 4)] and split.held_out.decode_tokens == 4
    with pytest.raises(BadInput, match="cannot hold out"):
        split_by_prompts(captured, 4)
