"""llama.cpp is the judge of drop-in: original and repacked models give the same logits."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from moepack.checkpoint import MoeModel
from moepack.checkpoint.gguf_file import GgufFile
from moepack.checkpoint.synth import SynthSpec, synth_model
from moepack.errors import MoepackError
from moepack.layout.plan import LayerPlan, Plan
from moepack.llama.judge.judge import judge, run_logits
from moepack.rewrite.repack import repack
from moepack.rewrite.verify import verify

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
pytestmark = pytest.mark.slow


def _plan(path, seed: int) -> Plan:
    m = MoeModel(path)
    rng = np.random.default_rng(seed)
    return Plan([LayerPlan(b.index, rng.permutation(b.n_expert)) for b in m.blocks], m.fingerprint)


@pytest.fixture(scope="module", params=["F32", "Q8_0", "Q4_K_M"])
def original(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return synth_model(d / "m.gguf", SynthSpec(weight_type=request.param, seed=3)).paths[0]


def test_permuted_experts_give_the_same_logits(original, tmp_path):
    for seed in (0, 1):
        out = repack(original, _plan(original, seed), tmp_path / f"r{seed}.gguf").outputs[0]
        r = judge(original, out)
        assert r.max_abs_diff <= 1e-5, r
        assert r.argmax_agreement == 1.0, r


def reorder_tensors(src: Path, dst: Path, infos_too: bool = True) -> Path:
    """The same GGUF with its tensors' bytes in reverse order in the data section, and (with
    ``infos_too``) the tensor-info entries reversed to match. Names, types, shapes and bytes
    are unchanged; only the layout moves."""
    g = GgufFile(src)
    raw = src.read_bytes()
    first_info = min(t.info_start for t in g.tensors)
    infos, body = {}, bytearray()
    for t in reversed(g.tensors):
        body += bytes((-len(body)) % g.alignment)
        entry = bytearray(raw[t.info_start : t.info_end])
        entry[-8:] = struct.pack("<Q", len(body))
        infos[t.name] = bytes(entry)
        body += raw[t.offset : t.end]
    body += bytes((-len(body)) % g.alignment)
    order = reversed(g.tensors) if infos_too else g.tensors
    head = raw[:first_info] + b"".join(infos[t.name] for t in order)
    dst.write_bytes(head + bytes((-len(head)) % g.alignment) + bytes(body))
    return dst


def test_reordered_tensors_give_bit_identical_logits(original, tmp_path):
    shuffled = reorder_tensors(original, tmp_path / "shuffled.gguf")
    assert GgufFile(shuffled).tensors[0].name == GgufFile(original).tensors[-1].name
    assert verify(original, shuffled).ok  # every byte accounted for, in another layout
    assert judge(original, shuffled).bit_identical


def test_data_out_of_tensor_info_order_does_not_load(original, tmp_path):
    """ggml requires tensor data in tensor-info order: verify says so before llama.cpp does."""
    moved = reorder_tensors(original, tmp_path / "moved.gguf", infos_too=False)
    v = verify(original, moved)
    assert v.difference is not None
    assert not v.ok and v.difference.what == "layout"
    with pytest.raises(MoepackError, match="could not run"):
        run_logits(moved, np.array([1, 5]))


def test_identity_repack_gives_bit_identical_logits(original, tmp_path):
    m = MoeModel(original)
    identity = Plan([LayerPlan(b.index, np.arange(b.n_expert)) for b in m.blocks], m.fingerprint)
    out = repack(original, identity, tmp_path / "same.gguf").outputs[0]
    assert judge(original, out).bit_identical


def test_the_judge_catches_a_broken_repack(original, tmp_path):
    """Permuting the expert matrices but not the router rows changes the model: llama.cpp sees it."""
    plan = _plan(original, 5)
    broken = repack(original, plan, tmp_path / "broken.gguf", assume_not_expert=("*ffn_gate_inp*",))
    r = judge(original, broken.outputs[0])
    assert r.max_abs_diff > 1e-3 and not r.ok


def test_synthesis_writes_the_requested_weight_type(original):
    m = MoeModel(original)
    kinds = {t.entry.type_name for b in m.blocks for t in b.weight_tensors}
    router = {t.entry.type_name for b in m.blocks for t in b.tensors if t.kind == "router"}
    assert router == {"F32"}  # routers stay F32, as llama.cpp keeps them
    requested = m.shards[0].get("moepack.synth.spec")
    if "'F32'" in requested:
        assert kinds == {"F32"}
    elif "'Q8_0'" in requested:
        assert kinds == {"Q8_0"}
    else:  # Q4_K_M: llama.cpp's mix of K-quants, Q4_K among them, nothing unquantised
        assert "Q4_K" in kinds and kinds <= {"Q4_K", "Q5_K", "Q6_K"}
    logits = run_logits(original, np.array([1, 5, 9, 300]))
    assert logits.shape == (4, 320) and np.isfinite(logits).all()
