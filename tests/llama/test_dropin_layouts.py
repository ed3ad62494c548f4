"""Stock llama.cpp judges every drop-in layout on every synthetic architecture that takes it:
``check-dropin`` passes all four gates (bytes, control, routing mapped back, output KL)."""

from __future__ import annotations

import json

import pytest

from moefixtures import grouped_plan, run_cli, tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.archs import get_arch
from moepack.checkpoint.fused_archs import takes_fused_gate_up
from moepack.checkpoint.synth import synth_model
from moepack.rewrite.repack import repack

pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
pytestmark = pytest.mark.slow

# (architecture, layout, alignment, weights): fused where llama.cpp's loader takes it, in the
# file's own order and pipelined, F32 and K-quants; pipeline, reorder and alignment everywhere.
CASES = [
    ("deepseek2", "fused", 0, "F32"),
    ("deepseek2", "reorder+fused+pipeline", 4096, "F32"),
    ("deepseek2", "reorder+fused+pipeline", 4096, "Q4_K_M"),
    ("mistral4", "reorder+fused", 4096, "F32"),
    ("qwen3moe", "reorder+pipeline", 4096, "F32"),
    ("qwen2moe", "reorder+pipeline", 4096, "F32"),
    ("mixtral", "reorder+pipeline", 4096, "F32"),
    ("gpt-oss", "reorder+pipeline", 4096, "F32"),
]


@pytest.mark.parametrize("arch, layout, align, weights", CASES)
def test_check_dropin_passes_each_layout(tmp_path, capsys, arch, layout, align, weights):
    assert ("fused" in layout) == takes_fused_gate_up(get_arch(arch).gguf_arch)
    width = {"hidden": 256, "expert_ffn": 256} if weights != "F32" else {}  # K-quant rows
    spec = tiny_spec(arch=arch, layers=3, experts=8, top_k=2, seed=5, weight_type=weights, **width)
    original = synth_model(tmp_path / "m.gguf", spec).paths[0]
    with MoeModel(original) as m:
        plan = grouped_plan(m, 2) if "reorder" in layout else None
    out = repack(original, plan, tmp_path / "r.gguf", layout=layout, alignment=align).outputs[0]
    code, text, err = run_cli(
        capsys, "check-dropin", original, out, "--tokens", "256", "--json", "-q"
    )
    assert code == 0, err
    result = json.loads(text)
    gates = {g["gate"]: g for g in result["gates"]}
    assert result["verdict"] == "PASS"
    assert gates["routing"]["same_order"] == 1.0
    assert gates["output"]["kl"] <= gates["output"]["envelope_kl"]
    if plan is not None:
        assert gates["routing"]["permutation"] == "recorded"
        assert gates["bytes"]["tensors_permuted"] > 0
