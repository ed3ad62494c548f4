"""Expert axes written with trailing dimensions of 1 (ERNIE-4.5-MoE's ``exp_probs_b.bias`` is
``[n_expert, 1]`` from llama.cpp's converter, which stores every ``.bias`` as F32 whatever the
file type): the expert axis is found as llama.cpp's loader finds it, and what is genuinely
ambiguous is still refused."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from moepack.checkpoint import MoeModel
from moepack.checkpoint.experts import Role, classify, significant_ne
from moepack.errors import BadInput
from moepack.layout.plan import LayerPlan, Plan
from moepack.rewrite.repack import repack
from moepack.rewrite.verify import verify

E, N, F = 8, 64, 32
ARCH = "ernie4_5-moe"


def ernie_like(path, weight_type: str, bias_shape=(1, E), bias_type: str = "F32"):
    """A one-block ERNIE-4.5-MoE-shaped file: expert matrices in ``weight_type``, the router
    in F32, ``exp_probs_b.bias`` of numpy shape ``bias_shape`` (ggml ``[E, 1]``)."""
    rng = np.random.default_rng(7)
    w = GGUFWriter(path, ARCH)
    w.add_uint32(f"{ARCH}.expert_count", E)
    w.add_uint32(f"{ARCH}.expert_used_count", 2)
    w.add_uint32(f"{ARCH}.block_count", 1)

    def add(name: str, shape: tuple[int, ...], type_name: str) -> None:
        data = rng.standard_normal(shape).astype(np.float32)
        if type_name == "F32":
            w.add_tensor(name, data)
        elif type_name == "F16":
            w.add_tensor(name, data.astype(np.float16))
        else:
            qtype = GGMLQuantizationType[type_name]
            w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)

    add("blk.0.ffn_gate_inp.weight", (E, N), "F32")
    add("blk.0.exp_probs_b.bias", bias_shape, bias_type)
    add("blk.0.ffn_gate_exps.weight", (E, F, N), weight_type)
    add("blk.0.ffn_up_exps.weight", (E, F, N), weight_type)
    add("blk.0.ffn_down_exps.weight", (E, N, F), weight_type)
    add("blk.0.ffn_up_shexp.weight", (F, N), weight_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_significant_ne_drops_only_trailing_ones():
    assert significant_ne((64, 1)) == (64,)
    assert significant_ne((64, 1, 1)) == (64,)
    assert significant_ne((1, 64)) == (1, 64)
    assert significant_ne((1,)) == (1,)
    assert significant_ne((64, 1, 8)) == (64, 1, 8)


@pytest.mark.parametrize("weight_type", ["F32", "F16", "Q8_0"])
def test_expert_axis_with_a_trailing_one_is_permuted(tmp_path, weight_type):
    model = ernie_like(tmp_path / "m.gguf", weight_type)
    m = MoeModel(model)
    assert GGUFReader(model).tensors[1].shape.tolist() == [E, 1]  # ggml ne as written
    assert not m.flagged
    assert {t.kind for t in m.block(0).tensors} == {"router", "probs_bias", "gate", "up", "down"}
    perm = np.random.default_rng(2).permutation(E)
    res = repack(model, Plan([LayerPlan(0, perm)], m.fingerprint), tmp_path / "r.gguf")
    assert res.tensors_permuted == 5
    v = verify(model, tmp_path / "r.gguf")
    assert v.ok and v.tensors_permuted == 5
    orig = {t.name: np.asarray(t.data) for t in GGUFReader(model).tensors}
    out = {t.name: np.asarray(t.data) for t in GGUFReader(tmp_path / "r.gguf").tensors}
    bias = "blk.0.exp_probs_b.bias"
    assert np.array_equal(out[bias].reshape(-1), orig[bias].reshape(-1)[perm])
    assert np.array_equal(out["blk.0.ffn_up_shexp.weight"], orig["blk.0.ffn_up_shexp.weight"])


def test_a_dimension_that_is_not_one_is_still_ambiguous(tmp_path):
    model = ernie_like(tmp_path / "m.gguf", "F32", bias_shape=(2, E))  # ggml [E, 2]
    m = MoeModel(model)
    assert [f.name for f in m.ambiguous_in(0)] == ["blk.0.exp_probs_b.bias"]
    perm = np.roll(np.arange(E), 1)
    with pytest.raises(BadInput, match="cannot classify"):
        repack(model, Plan([LayerPlan(0, perm)], m.fingerprint), tmp_path / "r.gguf")


def test_expert_axis_inside_quantisation_blocks_is_refused():
    # [32] stored as Q8_0: one block holds all 32 experts' values; bytes cannot be permuted
    c = classify("blk.0.exp_probs_b.bias", (32, 1), 32, block_size=32)
    assert c.role is Role.AMBIGUOUS and "quantisation blocks" in c.reason
    declared = classify("blk.0.exp_probs_b.bias", (32, 1), 32, ("*exp_probs_b*",), block_size=32)
    assert declared.role is Role.AMBIGUOUS
    assert classify("blk.0.exp_probs_b.bias", (32, 1), 32, block_size=1).role is Role.EXPERT
