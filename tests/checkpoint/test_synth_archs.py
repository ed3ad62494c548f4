"""Every synthetic architecture goes through synth -> inspect -> plan -> repack -> verify, and
(slow) loads and runs in llama.cpp in F32, Q8_0 and a K-quant, repacked or not."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.archs import arch_names, get_arch
from moepack.checkpoint.gguf_file import GgufFile
from moepack.checkpoint.synth import SynthSpec, synth_model
from moepack.errors import BadInput
from moepack.layout.plan import LayerPlan, Plan
from moepack.rewrite.repack import repack
from moepack.rewrite.verify import verify

ARCHS = arch_names()
# every family with its defaults, plus the deepseek2 variants that change the tensors
VARIANTS = [(a, ()) for a in ARCHS] + [
    ("deepseek2", ("--fused-gate-up",)),
    ("deepseek2", ("--expert-groups", "1", "--dense-layers", "0", "--shared-experts", "2")),
]
VARIANT_IDS = [a + "".join(o[:1]) for a, o in VARIANTS]
TINY_SIZES = dict(
    layers=3,
    experts=8,
    top_k=2,
    hidden=64,
    expert_ffn=32,
    heads=2,
    kv_heads=1,
    head_dim=32,
    vocab=262,
)
TINY = tuple(x for k, v in TINY_SIZES.items() for x in (f"--{k.replace('_', '-')}", str(v)))


def test_the_families_are_registered():
    assert ARCHS[0] == "qwen3moe"
    assert {"qwen3moe", "deepseek2"} <= set(ARCHS)


@pytest.mark.parametrize("arch, options", VARIANTS, ids=VARIANT_IDS)
def test_synth_inspect_plan_repack_verify(capsys, tmp_path, arch, options):
    model, trace = tmp_path / "m.gguf", tmp_path / "t.moetrace"
    code, out, err = run_cli(
        capsys,
        "synth",
        "--arch",
        arch,
        "--out",
        model,
        "--trace-out",
        trace,
        *TINY,
        *options,
        "--tokens",
        "600",
        "--json",
        "-q",
    )
    assert code == 0, err
    assert json.loads(out)["model"]["spec"]["arch"] == arch
    code, out, err = run_cli(capsys, "inspect", model, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["architecture"] == get_arch(arch).gguf_arch
    moe = MoeModel(model).blocks
    assert moe and all(b.n_expert == 8 and b.top_k == 2 for b in moe)
    plan = tmp_path / "p.moeplan"
    code, _, err = run_cli(capsys, "plan", model, "--trace", trace, "--out", plan)
    assert code == 0, err
    code, _, err = run_cli(
        capsys, "repack", model, "--plan", plan, "--out", tmp_path / "r.gguf", "-q"
    )
    assert code == 0, err
    code, out, err = run_cli(capsys, "verify", model, tmp_path / "r.gguf", "--plan", plan)
    assert code == 0 and "OK" in out, err


def test_deepseek2_has_groups_dense_leading_blocks_shared_experts_and_probs_bias(tmp_path):
    spec = tiny_spec(arch="deepseek2", layers=3, experts=8, top_k=2, dense_layers=1)
    path = synth_model(tmp_path / "d.gguf", spec).paths[0]
    g = GgufFile(path)
    assert g.get("general.architecture") == "deepseek2"
    assert g.get("deepseek2.expert_group_count") == 4
    assert g.get("deepseek2.expert_group_used_count") == 2
    assert g.get("deepseek2.leading_dense_block_count") == 1
    assert g.get("deepseek2.expert_shared_count") == 1
    names = {t.name for t in g.tensors}
    assert "blk.0.ffn_gate.weight" in names and "blk.0.ffn_gate_inp.weight" not in names
    for b in (1, 2):
        for t in ("exp_probs_b.bias", "ffn_gate_shexp.weight", "attn_k_b.weight"):
            assert f"blk.{b}.{t}" in names
        assert f"blk.{b}.ffn_gate_exps.weight" in names
    m = MoeModel(path)
    assert [b.index for b in m.blocks] == [1, 2]


def test_deepseek2_fused_gate_up_replaces_gate_and_up(tmp_path):
    spec = tiny_spec(arch="deepseek2", fused_gate_up=True)
    g = GgufFile(synth_model(tmp_path / "f.gguf", spec).paths[0])
    names = {t.name for t in g.tensors}
    assert "blk.1.ffn_gate_up_exps.weight" in names
    assert "blk.1.ffn_gate_exps.weight" not in names and "blk.1.ffn_up_exps.weight" not in names


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(arch="qwen3moe", shared_experts=1), "not an option of qwen3moe"),
        (dict(arch="deepseek2", expert_groups=3), "multiple of expert groups"),
        (dict(arch="deepseek2", expert_groups=4, groups_used=4), "groups used"),
        (dict(arch="deepseek2", dense_layers=2, layers=2), "at least one MoE layer"),
        (dict(arch="nosuch"), "unknown architecture 'nosuch'"),
    ],
)
def test_bad_family_options_are_one_line_refusals(tmp_path, kw, message):
    with pytest.raises(BadInput, match=message):
        synth_model(tmp_path / "x.gguf", tiny_spec(**kw))
    assert list(tmp_path.iterdir()) == []


def test_cli_refuses_an_option_the_family_lacks(capsys, tmp_path):
    code, _, err = run_cli(
        capsys, "synth", "--out", tmp_path / "m.gguf", "--fused-gate-up", *TINY, "-q"
    )
    assert code == 2 and "fused-gate-up is not an option of qwen3moe" in err
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ llama.cpp (slow)
def _random_plan(path) -> Plan:
    """A random expert order that keeps expert groups whole (grouped routing picks groups by
    position, so only moves within a group, or of whole groups, keep what a token computes)."""
    m = MoeModel(path)
    arch = m.shards[0].get("general.architecture")
    groups = int(m.shards[0].get(f"{arch}.expert_group_count", 1) or 1)
    rng = np.random.default_rng(7)
    layers = []
    for b in m.blocks:
        per = b.n_expert // groups
        order = [g * per + rng.permutation(per) for g in rng.permutation(groups)]
        layers.append(LayerPlan(b.index, np.concatenate(order)))
    return Plan(layers, m.fingerprint)


@pytest.mark.slow
@pytest.mark.parametrize("weight_type", ["F32", "Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("arch, options", VARIANTS, ids=VARIANT_IDS)
def test_llama_cpp_runs_every_family_and_its_repack(tmp_path, arch, options, weight_type):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
    from moepack.llama.judge.judge import judge

    extra: dict[str, Any] = dict(fused_gate_up=True) if "--fused-gate-up" in options else {}
    if "--expert-groups" in options:
        extra = dict(expert_groups=1, dense_layers=0, shared_experts=2)
    spec = SynthSpec(arch=arch, layers=3, weight_type=weight_type, seed=1, **extra)
    original = synth_model(tmp_path / "m.gguf", spec).paths[0]
    repacked = repack(original, _random_plan(original), tmp_path / "r.gguf").outputs[0]
    assert verify(original, repacked).ok
    # Permuted experts change the order of the router softmax's F32 sum: ~1e-5 on logits of
    # unit scale. In a quantised file that rounding reaches the next layer's input, which is
    # quantised to Q8, and a value moved across a Q8 step shows in the logits: qwen2moe, which
    # does not renormalise the top-k weights, always; the others where the sum's order happens
    # to move one (qwen35moe Q4_K_M built for AVX-512, whose softmax sums 16 lanes at once:
    # 0.034, with check-dropin's KL at 0.15 of its envelope). F32 files keep the tight bound.
    loose = weight_type != "F32"
    r = judge(original, repacked, tolerance=0.05 if loose else 1e-4)
    assert r.ok, r
    assert r.vocab == spec.vocab


def test_gpt_oss_expert_biases_are_expert_axis_and_qwen2moe_shared_gate_is_not(tmp_path):
    oss = MoeModel(synth_model(tmp_path / "o.gguf", tiny_spec(arch="gpt-oss")).paths[0])
    names = {t.name for t in oss.blocks[0].tensors}
    for t in ("ffn_gate_inp.bias", "ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias"):
        assert f"blk.0.{t}" in names
    q2 = MoeModel(synth_model(tmp_path / "q.gguf", tiny_spec(arch="qwen2moe")).paths[0])
    names = {t.name for t in q2.blocks[0].tensors}
    assert names == {
        f"blk.0.ffn_{t}.weight" for t in ("gate_inp", "gate_exps", "up_exps", "down_exps")
    }
    assert q2.ambiguous_in(0) == []
