"""The K-quant (and MXFP4_MOE) files synth writes directly are the files llama.cpp's own
``llama_model_quantize`` makes of the same model in F32: every tensor the same type and the
same bytes (same F32 values, same ggml quantiser, no importance matrix), and the same
``general.file_type``. At full size, the shapes people run get llama.cpp's own type for every
tensor, from its dry run on a hollow F32 file (nothing written, nothing read)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader

from moepack.checkpoint.ftypes import LLAMA_FTYPES
from moepack.checkpoint.shapes import SHAPES, get_shape
from moepack.checkpoint.synth import SynthSpec, synth_model
from moepack.checkpoint.synth_plan import tensor_nbytes, tensor_types
from quantfixtures import HAVE_GGML, hollow_f32, llama_dry_run, llama_quantise

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not HAVE_GGML, reason="llama-cpp-python (libggml-base) missing"),
]

# Nine layers, so that "use more bits" picks some layers and not others.
_SMALL: dict[str, Any] = dict(layers=9, hidden=256, expert_ffn=256, experts=16, top_k=2, vocab=300)
CASES = [
    # qwen3moe: GQA 2 (Q2_K's value projections Q3_K), attn_v by layer
    ("qwen3moe", SynthSpec(**_SMALL), ("Q4_K_M", "Q3_K_M", "Q2_K", "Q4_K_S", "Q6_K")),
    # GQA 4 (Q2_K's value projections Q4_K), an embedding tied to the head
    ("qwen3moe-tied", SynthSpec(**_SMALL, heads=8, kv_heads=2, with_output=False), ("Q2_K",)),
    # delta-net layers: attn_qkv counts with attn_v; rows of 128 fall back from K blocks
    (
        "qwen35moe",
        SynthSpec(
            **{**_SMALL, "expert_ffn": 128},
            arch="qwen35moe",
            heads=4,
            kv_heads=1,
            linear_heads=4,
            linear_key_heads=2,
        ),
        ("Q4_K_M", "Q5_K_M", "Q3_K_L"),
    ),
    # 8 experts: attn_k and attn_v Q8_0, attn_output Q5_K
    ("mixtral", SynthSpec(**{**_SMALL, "experts": 8}, arch="mixtral"), ("Q4_K_M", "Q3_K_S")),
    # MLA's 3-D attn_k_b / attn_v_b, rows of 128 (q_lora), dense and shared FFNs
    ("deepseek2", SynthSpec(**_SMALL, arch="deepseek2", dense_ffn=512), ("Q4_K_M", "MXFP4_MOE")),
    # rows of 320: every K type falls back; MXFP4 experts as gpt-oss ships
    (
        "gpt-oss",
        SynthSpec(**{**_SMALL, "hidden": 320, "expert_ffn": 320}, arch="gpt-oss"),
        ("Q4_K_M", "MXFP4_MOE"),
    ),
]


def _tensors(path: Path) -> tuple[dict[str, tuple[str, bytes]], GGUFReader]:
    reader = GGUFReader(path)
    out = {
        t.name: (t.tensor_type.name, np.asarray(t.data).view(np.uint8).tobytes())
        for t in reader.tensors
    }
    return out, reader


def _field(reader: GGUFReader, key: str) -> object:
    return reader.fields[key].contents()


@pytest.mark.parametrize("name, spec, ftypes", CASES, ids=[c[0] for c in CASES])
def test_synth_writes_the_bytes_llama_model_quantize_makes(tmp_path, name, spec, ftypes):
    f32 = synth_model(tmp_path / "f32.gguf", spec).paths[0]
    kinds: set[str] = set()
    for ftype in ftypes:
        theirs_path = tmp_path / f"{ftype}-llama.gguf"
        proc = llama_quantise(f32, theirs_path, LLAMA_FTYPES[ftype])
        assert proc.returncode == 0, proc.stderr[-1000:]
        ours_path = synth_model(tmp_path / f"{ftype}.gguf", replace(spec, weight_type=ftype))
        theirs, rt = _tensors(theirs_path)
        ours, ro = _tensors(ours_path.paths[0])
        assert set(ours) == set(theirs)
        for t in theirs:
            assert ours[t][0] == theirs[t][0], (ftype, t)
            assert ours[t][1] == theirs[t][1], (ftype, t, "bytes differ")
        assert _field(ro, "general.file_type") == _field(rt, "general.file_type")
        assert _field(ro, "general.file_type") == LLAMA_FTYPES[ftype]
        assert _field(ro, "general.quantization_version") == _field(
            rt, "general.quantization_version"
        )
        kinds |= {t for t, _ in ours.values()}
        theirs_path.unlink()
        ours_path.paths[0].unlink()
    assert len(kinds - {"F32"}) >= 2, f"one quantised type checks little of the mix: {kinds}"


@pytest.mark.parametrize("shape", [s.name for s in SHAPES])
def test_every_shape_at_full_size_gets_llama_cpps_type_for_every_tensor(tmp_path, shape):
    """The whole model (Qwen3-30B-A3B is 122 GB in F32) as a hole: llama.cpp's loader reads
    its header, and its quantiser's dry run says the type and size of every tensor."""
    spec = get_shape(shape).spec()
    hollow = hollow_f32(spec, tmp_path / "hollow.gguf")
    assert hollow.stat().st_blocks * 512 < 64 << 20  # a header, not 100 GB of data
    runs = llama_dry_run(hollow, list(LLAMA_FTYPES.values()))
    for ftype, code in LLAMA_FTYPES.items():
        theirs, mib = runs[code]
        typed = tensor_types(replace(spec, weight_type=ftype))
        assert {t.name: q.name for t, q in typed} == theirs, ftype
        ours_bytes = sum(tensor_nbytes(t.shape, q) for t, q in typed)
        assert ours_bytes / 2**20 == pytest.approx(mib, abs=0.006), ftype
