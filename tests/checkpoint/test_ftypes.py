"""llama.cpp's per-tensor type mix, on the shapes people run (no llama.cpp needed: the rules
are checked against llama.cpp itself in test_ftypes_llama.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gguf.constants import GGMLQuantizationType as T

from moepack.checkpoint.shapes import get_shape
from moepack.checkpoint.synth_plan import plan_synth, tensor_types

# Qwen3-30B-A3B's 48 layers: the first and last six, and every third from layer 8 ("use more
# bits" in llama.cpp), whose attn_v and ffn_down_exps Q4_K_M writes in Q6_K.
MORE_BITS_48 = set(range(6)) | set(range(42, 48)) | set(range(8, 42, 3))


def _types(shape: str, weight_type: str, **kw: Any) -> dict[str, T]:
    spec = replace(get_shape(shape).spec(), weight_type=weight_type, **kw)
    return {t.name: q for t, q in tensor_types(spec)}


def test_q4_k_m_of_qwen3_30b_a3b_is_llama_cpps_mix():
    types = _types("qwen3-30b-a3b", "Q4_K_M")
    assert types["output.weight"] == T.Q6_K
    assert types["token_embd.weight"] == T.Q4_K  # not tied: the embedding keeps the default
    for b in range(48):
        more = T.Q6_K if b in MORE_BITS_48 else T.Q4_K
        assert types[f"blk.{b}.attn_v.weight"] == more, b
        assert types[f"blk.{b}.ffn_down_exps.weight"] == more, b
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate_exps", "ffn_up_exps"):
            assert types[f"blk.{b}.{name}.weight"] == T.Q4_K
        for name in ("attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm", "ffn_gate_inp"):
            assert types[f"blk.{b}.{name}.weight"] == T.F32
    assert len(MORE_BITS_48) == 24


def test_the_mix_of_each_k_file_type_on_qwen3_30b_a3b():
    """Tensors per type, as llama.cpp's own dry run (``llama_model_quantize`` with
    ``dry_run``, llama-cpp-python 0.3.36) reports them for this model."""
    counts = {
        "Q2_K": {T.Q2_K: 193, T.Q3_K: 96, T.Q6_K: 1, T.Q4_K: 48, T.F32: 241},
        "Q3_K_M": {T.Q3_K: 193, T.Q4_K: 139, T.Q5_K: 5, T.Q6_K: 1, T.F32: 241},
        "Q4_K_S": {T.Q4_K: 327, T.Q5_K: 10, T.Q6_K: 1, T.F32: 241},
        "Q5_K_M": {T.Q5_K: 289, T.Q6_K: 49, T.F32: 241},
        "Q6_K": {T.Q6_K: 338, T.F32: 241},
    }
    for ftype, want in counts.items():
        types = _types("qwen3-30b-a3b", ftype)
        got = {t: list(types.values()).count(t) for t in set(types.values())}
        assert got == want, ftype


def test_rows_that_are_not_whole_256_blocks_fall_back_as_llama_cpp_does():
    """gpt-oss is 2880 wide: 11.25 blocks of 256."""
    types = _types("gpt-oss-20b", "Q4_K_M", layers=8)
    assert types["blk.0.ffn_gate_exps.weight"] == T.Q5_0  # Q4_K -> Q5_0
    assert types["blk.0.ffn_down_exps.weight"] == T.Q8_0  # Q6_K (more bits) -> Q8_0
    assert types["blk.2.ffn_down_exps.weight"] == T.Q5_0  # not a "more bits" layer
    assert types["output.weight"] == T.Q8_0  # not whole blocks: Q8_0 instead of Q6_K
    assert types["blk.0.attn_q.weight"] == T.Q5_0
    assert types["blk.0.attn_output.weight"] == T.Q4_K  # rows of 64 x 64 = 4096


def test_mxfp4_moe_puts_experts_in_mxfp4_and_the_rest_in_q8_0():
    types = _types("gpt-oss-20b", "MXFP4_MOE", layers=2)
    for b in range(2):
        for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            assert types[f"blk.{b}.{name}.weight"] == T.MXFP4
        assert types[f"blk.{b}.attn_q.weight"] == T.Q8_0
        assert types[f"blk.{b}.ffn_gate_exps.bias"] == T.F32
        assert types[f"blk.{b}.attn_sinks.weight"] == T.F32
    assert types["token_embd.weight"] == types["output.weight"] == T.Q8_0


def test_eight_experts_and_a_tied_embedding():
    """Mixtral's rules: attn_k and attn_v Q8_0, attn_output Q5_K; without output.weight the
    embedding is the head and takes its Q6_K."""
    types = _types("mixtral-8x7b", "Q4_K_M", layers=4, with_output=False)
    assert types["blk.0.attn_k.weight"] == types["blk.3.attn_v.weight"] == T.Q8_0
    assert types["blk.1.attn_output.weight"] == T.Q5_K
    assert types["token_embd.weight"] == T.Q6_K
    assert "output.weight" not in types


def test_delta_net_qkv_counts_as_a_value_projection():
    """qwen35moe: each layer has one attn_v or one attn_qkv, and llama.cpp counts them as one
    sequence for "use more bits"."""
    types = _types("qwen3.6-35b-a3b", "Q4_K_M")
    more = {b for b in range(40) if b < 5 or b >= 35 or (b - 5) % 3 == 2}
    for b in range(40):
        name = "attn_v" if (b + 1) % 4 == 0 else "attn_qkv"
        assert types[f"blk.{b}.{name}.weight"] == (T.Q6_K if b in more else T.Q4_K), b
    assert types["blk.0.ssm_conv1d.weight"] == T.F32


def test_the_plan_of_a_k_file_counts_its_types_bytes():
    spec = replace(get_shape("qwen3-30b-a3b").spec(), weight_type="Q4_K_M", layers=1, vocab=512)
    plan = plan_synth(spec)
    experts = 128 * 768 * 2048
    q4k, q6k = 144 / 256, 210 / 256  # bytes per value
    assert next(t for t in plan.tensors if t.plan.name == "blk.0.ffn_up_exps.weight").nbytes == (
        experts * q4k
    )
    assert next(t for t in plan.tensors if t.plan.name == "blk.0.ffn_down_exps.weight").nbytes == (
        experts * q6k
    )
