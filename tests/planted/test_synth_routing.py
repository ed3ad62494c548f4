"""Planted routing (`synth --routing`): what is recorded, the prompts, and (slow) that
llama.cpp's actual top-k shows the clusters, reuse, coupling and popularity that were asked."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint.archs import arch_names
from moepack.checkpoint.gguf_file import GgufFile
from moepack.checkpoint.routing import RoutingSpec, routing_plan
from moepack.checkpoint.synth import SynthSpec, synth_model
from moepack.errors import BadInput
from moepack.keys import SYNTH_ROUTING
from moepack.planted.routing_check import check_routing
from moepack.planted.routing_prompts import load_routing_plan, routing_prompts, topic_chain
from moepack.trace.core import RoutingTrace


def test_parse_reads_every_key_and_refuses_unknown_ones():
    r = RoutingSpec.parse("cluster=8, stay=0.7,coupling=0.9,skew=1.5")
    assert r == RoutingSpec(cluster_size=8, stay=0.7, coupling=0.9, skew=1.5)
    assert RoutingSpec.parse("") == RoutingSpec()
    assert RoutingSpec.parse("stay=0.5", cluster=4) == RoutingSpec(cluster_size=4, stay=0.5)
    assert RoutingSpec.parse("cluster=2", cluster=4).cluster_size == 2
    for bad in ("clusters=8", "stay", "stay=high"):
        with pytest.raises(BadInput, match="routing spec"):
            RoutingSpec.parse(bad)


@pytest.mark.parametrize(
    "routing, message",
    [
        (RoutingSpec(cluster_size=3), "must divide the expert count"),
        (RoutingSpec(cluster_size=8), "at least 2 clusters"),
        (RoutingSpec(cluster_size=1), "top-k 2 must be at most the cluster size 1"),
        (RoutingSpec(cluster_size=2, stay=1.5), "stay must be between 0 and 1"),
        (RoutingSpec(cluster_size=2, coupling=-0.1), "coupling must be between 0 and 1"),
        (RoutingSpec(cluster_size=2), "at least 2 words per topic"),
    ],
)
def test_bad_routing_specs_write_nothing(tmp_path, routing, message):
    with pytest.raises(BadInput, match=message):
        synth_model(tmp_path / "m.gguf", tiny_spec(routing=routing))
    assert list(tmp_path.iterdir()) == []


def test_the_plan_is_recorded_and_reads_back(tmp_path):
    spec = tiny_spec(layers=3, vocab=400, routing=RoutingSpec(cluster_size=2, stay=0.6, skew=1.0))
    path = synth_model(tmp_path / "m.gguf", spec).paths[0]
    plan, vocab = load_routing_plan(path)
    want = routing_plan(spec)
    assert vocab == spec.vocab and plan.spec == spec.routing and plan.blocks == (0, 1, 2)
    assert np.array_equal(plan.members, want.members)
    assert np.array_equal(plan.topic_cluster, want.topic_cluster)
    # every layer's clusters partition the experts, scattered (not simply 0-1, 2-3, ...)
    for li in range(3):
        assert sorted(plan.members[li].ravel().tolist()) == list(range(8))
    assert not all(np.array_equal(m.ravel(), np.arange(8)) for m in plan.members)
    assert plan.popularity[np.argsort(-plan.popularity)][0] > 2 * plan.popularity.min()
    assert "routing" in GgufFile(path).get("moepack.synth.spec")
    assert json.loads(GgufFile(path).get(SYNTH_ROUTING))["cluster_size"] == 2


def test_clusters_never_cross_expert_groups(tmp_path):
    spec = tiny_spec(
        arch="deepseek2", layers=3, experts=16, top_k=2, routing=RoutingSpec(cluster_size=2)
    )
    plan = routing_plan(spec)
    assert plan.blocks == (1, 2)  # block 0 is dense
    per_group = 16 // 4
    for li in range(2):
        for members in plan.members[li]:
            assert len({int(e) // per_group for e in members}) == 1
    with pytest.raises(BadInput, match="divide the group size"):
        synth_model(
            tmp_path / "d.gguf",
            tiny_spec(arch="deepseek2", experts=16, top_k=8, routing=RoutingSpec(cluster_size=8)),
        )


def test_a_model_without_planted_routing_has_no_plan(tmp_path):
    path = synth_model(tmp_path / "m.gguf", tiny_spec()).paths[0]
    with pytest.raises(BadInput, match="no planted routing"):
        load_routing_plan(path)


def test_topic_chains_stay_as_asked_and_follow_popularity():
    spec = tiny_spec(experts=16, routing=RoutingSpec(cluster_size=2, stay=0.75, skew=1.0))
    plan = routing_plan(spec)
    topics = topic_chain(plan, 40_000, np.random.default_rng(3))
    assert abs(np.mean(topics[1:] == topics[:-1]) - 0.75) < 0.01
    from moepack.planted.routing_check import stationary_topics

    seen = np.bincount(topics, minlength=plan.topics) / len(topics)
    assert np.abs(seen - stationary_topics(plan)).max() < 0.02


def test_prompts_carry_their_tokens_topics_and_text(tmp_path):
    spec = tiny_spec(vocab=400, routing=RoutingSpec(cluster_size=2))
    path = synth_model(tmp_path / "m.gguf", spec).paths[0]
    plan, vocab = load_routing_plan(path)
    prompts = routing_prompts(plan, vocab, prompts=3, tokens=50, seed=4)
    assert [len(p.tokens) for p in prompts] == [50, 50, 50]
    for p in prompts:
        assert all(t % plan.topics == z for t, z in zip(p.tokens, p.topics, strict=True))
        assert len(p.text.split(" ")) == 50
    assert routing_prompts(plan, vocab, 3, 50, seed=4) == prompts
    assert routing_prompts(plan, vocab, 3, 50, seed=5) != prompts


def test_cli_writes_model_prompts_and_trace_together(capsys, tmp_path):
    model, prompts = tmp_path / "m.gguf", tmp_path / "p.jsonl"
    code, out, err = run_cli(
        capsys,
        "synth",
        "--out",
        model,
        "--routing",
        "cluster=4,stay=0.9",
        "--prompts-out",
        prompts,
        "--prompts",
        "5",
        "--prompt-tokens",
        "20",
        "--json",
        "-q",
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc["model"]["spec"]["routing"]["cluster_size"] == 4 and doc["prompts"] == str(prompts)
    lines = [json.loads(line) for line in prompts.read_text().splitlines()]
    assert len(lines) == 5 and all(len(x["tokens"]) == 20 for x in lines)
    text = tmp_path / "p.txt"
    code, _, err = run_cli(
        capsys,
        "synth",
        "--out",
        tmp_path / "n.gguf",
        "--routing",
        "cluster=4",
        "--prompts-out",
        text,
        "--prompts",
        "2",
        "-q",
    )
    assert code == 0, err
    assert len(text.read_text().splitlines()) == 2


def test_cli_prompts_without_routing_is_refused(capsys, tmp_path):
    code, _, err = run_cli(
        capsys, "synth", "--out", tmp_path / "m.gguf", "--prompts-out", tmp_path / "p.txt", "-q"
    )
    assert code == 2 and "--prompts-out needs --routing" in err
    assert list(tmp_path.iterdir()) == []


def test_the_check_refuses_a_top_k_other_than_the_cluster_size():
    spec = tiny_spec(experts=8, top_k=2, routing=RoutingSpec(cluster_size=4))
    trace = RoutingTrace(ids=np.zeros((4, 2, 2), dtype=np.int32) + np.arange(2), n_expert=8)
    with pytest.raises(BadInput, match="top-k = cluster size"):
        check_routing(routing_plan(spec), spec.vocab, trace)


def test_the_planted_trace_is_each_tokens_cluster_and_binds_to_the_model(capsys, tmp_path):
    model, trace = tmp_path / "m.gguf", tmp_path / "t.moetrace"
    code, _, err = run_cli(
        capsys,
        "synth",
        "--out",
        model,
        "--routing",
        "cluster=4,stay=0.9,coupling=0.5",
        "--trace-out",
        trace,
        "--prompts",
        "3",
        "--prompt-tokens",
        "40",
        "--layers",
        "3",
        "-q",
    )
    assert code == 0, err
    from moepack.checkpoint import MoeModel
    from moepack.checkpoint.routing import token_clusters
    from moepack.planted.routing_trace import recorded_spec
    from moepack.trace import load_trace

    t = load_trace(trace, model=MoeModel(model))
    spec = recorded_spec(model)
    plan = routing_plan(spec)
    assert t.tokens == 120 and t.block_map == [0, 1, 2] and t.k == 4
    prompts = routing_prompts(plan, spec.vocab, 3, 40, seed=0)
    run = np.concatenate([p.tokens for p in prompts])
    clusters = token_clusters(spec, plan)[run]
    for li in range(3):
        want = np.sort(plan.members[li][clusters[:, li]], axis=1)
        assert np.array_equal(np.sort(t.ids[:, li], axis=1), want)
    # coupling 0.5: layers disagree about a token's topic about half the time
    assert 0.2 < np.mean(clusters[:, 1] != plan.topic_cluster[1][run % plan.topics]) < 0.8


# ------------------------------------------------------------------ llama.cpp (slow)
def _capture(path, prompts) -> RoutingTrace:
    from routing_capture import capture

    ids, blocks = capture(path, [p.tokens for p in prompts])
    keep = np.ones(len(ids), dtype=bool)
    keep[np.cumsum([0] + [len(p.tokens) + 1 for p in prompts[:-1]])] = False  # BOS rows
    n_expert = int(GgufFile(path).get(f"{GgufFile(path).get('general.architecture')}.expert_count"))
    return RoutingTrace(ids=ids[keep].astype(np.int32), n_expert=n_expert, block_map=blocks)


ROUTED = dict(
    layers=4,
    experts=16,
    top_k=4,
    vocab=2048,
    routing=RoutingSpec(cluster_size=4, stay=0.8, coupling=0.85, skew=1.0),
)


@pytest.mark.slow
@pytest.mark.parametrize("arch", arch_names())
def test_llama_cpp_routes_as_planted(tmp_path, arch):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
    path = synth_model(tmp_path / "m.gguf", SynthSpec(arch=arch, **ROUTED)).paths[0]  # type: ignore[arg-type]
    plan, vocab = load_routing_plan(path)
    prompts = routing_prompts(plan, vocab, prompts=12, tokens=200, seed=1)
    trace = _capture(path, prompts)
    assert trace.block_map == list(plan.blocks)
    check = check_routing(plan, vocab, trace)
    assert check.pure_clusters == 1.0 and check.cross_lift == 0.0, check.to_json()
    assert check.ok, check.to_json()
    # the numpy prediction from the recorded spec names the same experts on every (token, layer)
    from moepack.planted.routing_trace import planted_trace

    predicted = planted_trace(path, np.concatenate([p.tokens for p in prompts])).ids
    assert np.array_equal(np.sort(predicted, axis=2), np.sort(trace.ids, axis=2))
    assert np.mean(predicted == trace.ids) > 0.85  # in router order too, but for near-ties


@pytest.mark.slow
@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_K_M"])
def test_quantised_models_route_as_planted(tmp_path, weight_type):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
    spec = SynthSpec(weight_type=weight_type, **ROUTED)  # type: ignore[arg-type]
    path = synth_model(tmp_path / "m.gguf", spec).paths[0]
    plan, vocab = load_routing_plan(path)
    check = check_routing(plan, vocab, _capture(path, routing_prompts(plan, vocab, 12, 200)))
    assert check.ok and check.pure_clusters > 0.99, check.to_json()


@pytest.mark.slow
def test_prompt_text_tokenises_back_to_its_ids(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
    spec = tiny_spec(vocab=3000, routing=RoutingSpec(cluster_size=2))
    path = synth_model(tmp_path / "m.gguf", spec).paths[0]
    plan, vocab = load_routing_plan(path)
    prompts = routing_prompts(plan, vocab, prompts=4, tokens=300, seed=2)
    code = (
        "import sys, json, llama_cpp\n"
        "llm = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)\n"
        "texts = json.loads(sys.argv[2])\n"
        "print(json.dumps([llm.tokenize(t.encode(), add_bos=False) for t in texts]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path), json.dumps([p.text for p in prompts])],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-1000:]
    assert json.loads(proc.stdout) == [p.tokens for p in prompts]


@pytest.mark.slow
def test_mid_size_model_shows_clusters_of_8_of_64_and_reuse_above_0_6(tmp_path):
    """8 layers, 64 experts, top-8, hidden 1024: the size the capture benchmark uses."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
    spec = SynthSpec(
        layers=8,
        experts=64,
        top_k=8,
        hidden=1024,
        expert_ffn=128,
        heads=8,
        kv_heads=2,
        head_dim=128,
        vocab=4096,
        weight_type="Q8_0",
        routing=RoutingSpec(cluster_size=8, stay=0.8, coupling=0.95, skew=1.0),
    )
    path = synth_model(tmp_path / "m.gguf", spec).paths[0]
    plan, vocab = load_routing_plan(path)
    check = check_routing(plan, vocab, _capture(path, routing_prompts(plan, vocab, 8, 200)))
    assert check.ok and check.pure_clusters > 0.99, check.to_json()
    assert check.measured.reuse_lag1 >= 0.6, check.to_json()


def test_the_planner_gathers_the_planted_clusters(tmp_path):
    """What the routing is for: a layout planned from it makes every cluster one run."""
    from moepack.checkpoint import MoeModel
    from moepack.layout.coactivation_plan import plan_from_trace
    from moepack.planted.routing_trace import planted_trace

    spec = tiny_spec(layers=2, experts=16, top_k=4, vocab=400, routing=RoutingSpec(cluster_size=4))
    path = synth_model(tmp_path / "m.gguf", spec).paths[0]
    plan, vocab = load_routing_plan(path)
    run = np.concatenate([p.tokens for p in routing_prompts(plan, vocab, 4, 200)])
    outcome = plan_from_trace(MoeModel(path), planted_trace(path, run))
    assert outcome.requests_after < 0.5 * outcome.requests_before
    for li, layer in enumerate(outcome.plan.layers):
        slot = np.argsort(np.asarray(layer.perm))  # new slot of each old expert
        for members in plan.members[li]:
            s = np.sort(slot[members])
            assert s[-1] - s[0] == 3  # contiguous
