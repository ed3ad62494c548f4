"""``synth --shape``: the published models' sizes, checked without writing (the family takes
the shape, the plan counts its bytes as its config.json does), overridden by flags, listed in
the help, and (slow) the same families at small sizes load and run in llama.cpp."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from moefixtures import run_cli
from moepack.checkpoint.shapes import SHAPES, get_shape, synth_spec
from moepack.checkpoint.synth import SynthSpec, synth_model
from moepack.checkpoint.synth_plan import plan_synth, tensor_types
from moepack.errors import BadInput
from quantfixtures import HAVE_GGML


def _qwen3_30b_a3b_params() -> int:
    """From Qwen/Qwen3-30B-A3B's config.json."""
    v, h, layers, e, f, nh, nkv, hd = 151936, 2048, 48, 128, 768, 32, 4, 128
    attention = 2 * h * nh * hd + 2 * h * nkv * hd + 2 * hd
    layer = 2 * h + attention + e * h + 3 * e * f * h
    return 2 * v * h + h + layers * layer


def _qwen36_35b_a3b_params() -> int:
    """From Qwen/Qwen3.6-35B-A3B's config.json (text_config)."""
    v, h, layers, e, f, shared = 248320, 2048, 40, 256, 512, 512
    nh, nkv, hd = 16, 2, 256
    lv, lk, lhd, kernel = 32, 16, 128, 4
    full = 2 * nh * hd * h + 2 * nkv * hd * h + 2 * hd + nh * hd * h
    conv = 2 * lk * lhd + lv * lhd
    linear = conv * h + lv * lhd * h + conv * kernel + 2 * lv + 2 * lv * h + lhd + h * lv * lhd
    moe = 2 * h + e * h + 3 * e * f * h + h + 3 * shared * h
    mixers = sum(full if (b + 1) % 4 == 0 else linear for b in range(layers))
    return 2 * v * h + h + mixers + layers * moe


@pytest.mark.parametrize("shape", [s.name for s in SHAPES])
def test_every_shape_is_a_model_its_family_takes(shape):
    spec = get_shape(shape).spec()
    spec.validate()
    plan = plan_synth(replace(spec, weight_type="Q4_K_M"))
    assert plan.file_bytes > plan.tensor_bytes > 10**9
    # the context the published model takes, as its config.json gives it
    assert spec.context >= 32768
    assert f"max_position_embeddings {spec.context}" in get_shape(shape).source
    for weight_type in ("F32", "Q4_0", "Q8_0", "MXFP4_MOE"):
        typed = tensor_types(replace(spec, weight_type=weight_type))
        assert len(typed) == len(plan.tensors)


@pytest.mark.parametrize(
    "shape, params, total",
    [
        ("qwen3-30b-a3b", _qwen3_30b_a3b_params(), 30.5e9),
        ("qwen3.6-35b-a3b", _qwen36_35b_a3b_params(), 34.7e9),
    ],
)
def test_the_shapes_count_their_configs_parameters(shape, params, total):
    plan = plan_synth(get_shape(shape).spec())
    assert plan.tensor_bytes == 4 * params
    assert params == pytest.approx(total, rel=0.01)


def test_qwen3_30b_a3b_in_q4_0_and_q4_k_m_is_the_size_people_download():
    spec = get_shape("qwen3-30b-a3b").spec()
    assert round(plan_synth(replace(spec, weight_type="Q4_0")).file_bytes / 1e9, 2) == 17.24
    assert round(plan_synth(replace(spec, weight_type="Q4_K_M")).file_bytes / 1e9, 1) == 18.6
    oss = replace(get_shape("gpt-oss-20b").spec(), weight_type="MXFP4_MOE")
    assert round(plan_synth(oss).file_bytes / 1e9, 1) == 12.1  # openai's MXFP4 file: 12.1 GB


def test_flags_given_override_the_shape_and_the_rest_is_the_shapes():
    spec = synth_spec("qwen3.6-35b-a3b", layers=4, vocab=None, weight_type="Q4_K_M")
    assert (spec.layers, spec.experts, spec.vocab, spec.linear_heads) == (4, 256, 248320, 32)
    assert spec.weight_type == "Q4_K_M"
    assert synth_spec(None, layers=3) == SynthSpec(layers=3)
    routed = synth_spec("qwen3-30b-a3b", routing_text="")
    assert routed.routing is not None and routed.routing.cluster_size == 8  # the shape's top-k
    with pytest.raises(BadInput, match="unknown shape 'qwen9'; known: qwen3-30b-a3b"):
        synth_spec("qwen9")


def test_cli_dry_run_says_the_bytes_of_a_shape_and_writes_nothing(capsys, tmp_path):
    out = tmp_path / "m.gguf"
    code, text, err = run_cli(
        capsys, "synth", "--out", out, "--shape", "qwen3-30b-a3b", "--layers", "4",
        "--weight-type", "Q4_K_M", "--dry-run", "--json",
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads(text)
    assert doc["spec"]["layers"] == 4 and doc["spec"]["experts"] == 128
    assert doc["spec"]["context"] == 40960
    spec = replace(get_shape("qwen3-30b-a3b").spec(), layers=4, weight_type="Q4_K_M")
    assert doc["file_bytes"] == plan_synth(spec).file_bytes
    # 4 layers: "more bits" are layers 2 and 3 (attn_v, ffn_down_exps), and the head
    assert doc["types"] == {"Q4_K": 25, "Q6_K": 5, "F32": 21}
    assert list(tmp_path.iterdir()) == []
    code, text, _ = run_cli(capsys, "synth", "--out", out, "--shape", "gpt-oss-20b", "--dry-run")
    assert code == 0 and "gpt-oss F32: 387 tensors" in text and "nothing written" in text


def test_help_lists_every_shape_and_its_model(capsys):
    code, text, _ = run_cli(capsys, "synth", "--help")
    assert code == 0
    for s in SHAPES:
        assert f"{s.name}: {s.model}" in text


def test_a_shape_with_a_family_option_the_arch_flag_drops_is_refused(tmp_path):
    spec = synth_spec("qwen3.6-35b-a3b", arch="qwen3moe")
    with pytest.raises(BadInput, match="shared-experts is not an option of qwen3moe"):
        synth_model(tmp_path / "m.gguf", spec)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ llama.cpp (slow)
def _scaled(shape: str) -> SynthSpec:
    """The shape's family and options at test size: GQA and delta-net head ratios kept, rows
    that are not whole 256-blocks kept where the shape has them (gpt-oss, GLM-4.5-Air)."""
    s = get_shape(shape).spec()
    odd = s.hidden % 256 != 0 or s.expert_ffn % 256 != 0
    small: dict[str, Any] = dict(
        layers=4,
        experts=8,
        top_k=2,
        hidden=320 if odd else 256,
        expert_ffn=160 if odd else 128,
        heads=s.heads // s.kv_heads,
        kv_heads=1,
        head_dim=32,
        vocab=512,
    )
    if s.linear_heads is not None and s.linear_key_heads is not None:
        small.update(linear_heads=s.linear_heads // s.linear_key_heads, linear_key_heads=1)
        small.update(linear_head_dim=32)
    if s.dense_ffn is not None:
        small["dense_ffn"] = 384
    weight_type = get_shape(shape).published.split(",")[0].split()[0]
    return replace(s, **small, weight_type=weight_type)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_GGML, reason="llama-cpp-python (libggml-base) missing")
@pytest.mark.parametrize("shape", [s.name for s in SHAPES])
def test_each_shape_at_small_size_runs_in_llama_cpp(tmp_path, shape):
    from moepack.llama.runtime.run import RunOptions, run_model

    spec = _scaled(shape)
    path = synth_model(tmp_path / "m.gguf", spec).paths[0]
    r = run_model(path, "a b c", RunOptions(n_predict=4, n_ctx=256, threads=1))
    assert len(r.generated) == 4, (shape, spec.weight_type)
