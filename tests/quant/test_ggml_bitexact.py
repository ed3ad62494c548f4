"""gguf-py's dequantisers against ggml's own C dequantisers, bit for bit, on tensors that
llama.cpp's quantiser made itself."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from moepack.checkpoint import MoeModel
from moepack.quant.engine import DEQUANT_ENGINES, engine_for
from quantfixtures import FTYPES, HAVE_GGML, NEED_IMATRIX, f32_model, llama_quantise

pytestmark = pytest.mark.skipif(not HAVE_GGML, reason="llama-cpp-python (libggml-base) missing")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return f32_model(tmp_path_factory.mktemp("bitexact"))


@pytest.mark.parametrize("ftype_name", sorted(FTYPES))
def test_gguf_py_equals_ggml_bit_for_bit(tmp_path, source, ftype_name):
    ftype, expert_type = FTYPES[ftype_name]
    out = tmp_path / f"{ftype_name}.gguf"
    proc = llama_quantise(source, out, ftype)
    assert proc.returncode == 0, proc.stderr[-500:]
    gguf_py, ggml = DEQUANT_ENGINES.get("gguf"), DEQUANT_ENGINES.get("ggml")
    checked: set[str] = set()
    with MoeModel(out) as m:
        data = m.shards[0].reader.data
        assert m.tensors["blk.0.ffn_up_exps.weight"].type_name == expert_type
        for t in m.tensors.values():
            if t.ggml_type == GGMLQuantizationType.F32:
                continue  # ggml has no F32 "dequantiser"; nothing to decode
            assert gguf_py.supports(t.ggml_type) and ggml.supports(t.ggml_type), t.type_name
            raw = np.asarray(data[t.offset : t.end])
            ours = gguf_py.dequantize(raw, t.ggml_type)
            theirs = ggml.dequantize(raw, t.ggml_type)
            assert ours.shape == theirs.shape == (int(np.prod(t.ne)),)
            differ = np.flatnonzero(ours.view(np.uint32) != theirs.view(np.uint32))
            assert differ.size == 0, (
                f"{t.name} ({t.type_name}): {differ.size} of {ours.size} values differ, "
                f"max |Δ| {np.max(np.abs(ours[differ] - theirs[differ]))}"
            )
            checked.add(t.type_name)
    assert expert_type in checked


@pytest.mark.parametrize("ftype_name", sorted(NEED_IMATRIX))
def test_llama_cpp_refuses_low_bit_iq_types_without_an_imatrix(tmp_path, source, ftype_name):
    """Why IQ1/IQ2/IQ3_XXS are not in the bit-exact list: llama.cpp will not make them here."""
    proc = llama_quantise(source, tmp_path / "x.gguf", NEED_IMATRIX[ftype_name])
    assert proc.returncode != 0
    assert "imatrix" in proc.stderr + proc.stdout


def test_ggml_knows_a_type_gguf_py_does_not_and_both_agree_on_the_rest():
    gguf_py, ggml = DEQUANT_ENGINES.get("gguf"), DEQUANT_ENGINES.get("ggml")
    both = [t for t in GGMLQuantizationType if gguf_py.supports(t) and ggml.supports(t)]
    assert {"Q4_K", "Q6_K", "IQ4_XS", "MXFP4", "TQ2_0"} <= {t.name for t in both}
    for t in (GGMLQuantizationType.I8, GGMLQuantizationType.I32):
        assert not gguf_py.supports(t) and not ggml.supports(t)
    # the types only ggml decodes: compare falls back to it, and its decoder really runs
    only_ggml = [t for t in GGMLQuantizationType if ggml.supports(t) and not gguf_py.supports(t)]
    assert only_ggml, "this llama.cpp decodes no type that gguf-py cannot"
    for t in only_ggml:
        assert engine_for(t, gguf_py) is ggml
        block, size = GGML_QUANT_SIZES[t]
        zeros = ggml.dequantize(np.zeros(4 * size, dtype=np.uint8), t)
        assert zeros.shape == (4 * block,) and not zeros.any()  # a zero scale decodes to zeros
