"""Opening GGUF files (single and split) and finding the expert axis by shape."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from moefixtures import tiny_spec, write_gguf
from moepack.checkpoint import MoeModel
from moepack.checkpoint.experts import Role
from moepack.checkpoint.gguf_file import GgufFile
from moepack.checkpoint.inspect import inspect_model
from moepack.checkpoint.synth import synth_model
from moepack.errors import BadInput


def test_metadata_values_match_gguf_py(tmp_path):
    """Our fast array parsing must give exactly what gguf-py's own reader gives."""
    (path,) = synth_model(tmp_path / "m.gguf", tiny_spec(vocab=1000)).paths
    ours = GgufFile(path)
    ref = GGUFReader(path)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert set(keys) == set(ours.kv)
    for k in keys:
        assert ours.kv[k].value() == ref.fields[k].contents(), k
        assert ours.kv[k].start == ref.fields[k].offset
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    assert [t.offset for t in ours.tensors] == [int(t.data_offset) for t in ref.tensors]
    assert ours.data_offset == ref.data_offset


def test_qwen3moe_detection_and_geometry(tmp_path):
    spec = tiny_spec(layers=3, experts=8, hidden=64, expert_ffn=32)
    (path,) = synth_model(tmp_path / "m.gguf", spec).paths
    m = MoeModel(path)
    assert m.architecture == "qwen3moe"
    assert m.moe_block_indices == [0, 1, 2]
    assert m.n_expert == 8 and m.top_k == 2
    kinds = {t.kind: t for t in m.blocks[0].tensors}
    assert set(kinds) == {"router", "gate", "up", "down"}
    assert kinds["gate"].slice_bytes == 64 * 32 * 4
    assert kinds["router"].slice_bytes == 64 * 4
    assert m.blocks[0].bytes_per_expert == 3 * 64 * 32 * 4 + 64 * 4
    assert not m.flagged
    # slice e really is expert e: regenerate the values and compare
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    up = kinds["up"]
    sl = np.frombuffer(raw[up.slice_offset(5) : up.slice_offset(6)].tobytes(), np.float32)
    full = GGUFReader(path).get_tensor([t.name for t in GGUFReader(path).tensors].index(up.name))
    assert np.array_equal(sl.reshape(32, 64), np.asarray(full.data)[5])


def test_shared_experts_and_other_families(tmp_path):
    """qwen2moe-style shared experts, fused gate_up, biases, exp_probs_b, chunk experts."""
    n, f, e = 64, 32, 8
    tensors = {
        "blk.0.attn_q_norm.weight": (e,),  # coincides with the expert count: not an expert tensor
        "blk.0.ffn_gate_inp.weight": (e, n),
        "blk.0.ffn_gate_inp_shexp.weight": (n,),
        "blk.0.ffn_gate_shexp.weight": (f, n),
        "blk.0.ffn_down_shexp.weight": (n, f),
        "blk.0.ffn_gate_up_exps.weight": (e, 2 * f, n),
        "blk.0.ffn_down_exps.weight": (e, n, f),
        "blk.0.ffn_down_exps.bias": (e, n),
        "blk.0.exp_probs_b.bias": (e,),
        "blk.0.ffn_up_chexps.weight": (4, f, n),
        "blk.1.ffn_up.weight": (f, n),  # a dense block
    }
    path = write_gguf(
        tmp_path / "x.gguf",
        "qwen2moe",
        tensors,
        {"qwen2moe.expert_count": e, "qwen2moe.expert_used_count": 2, "qwen2moe.block_count": 2},
    )
    m = MoeModel(path)
    assert m.moe_block_indices == [0]
    names = {t.name: t.kind for t in m.blocks[0].tensors}
    assert names == {
        "blk.0.ffn_gate_inp.weight": "router",
        "blk.0.ffn_gate_up_exps.weight": "gate_up",
        "blk.0.ffn_down_exps.weight": "down",
        "blk.0.ffn_down_exps.bias": "down",
        "blk.0.exp_probs_b.bias": "probs_bias",
    }
    roles = {fl.name: fl.role for fl in m.flagged}
    assert roles == {"blk.0.ffn_up_chexps.weight": Role.GROUP_AXIS}
    r = inspect_model(path)
    assert r.dense_blocks == [1] and r.moe_blocks == [0]


def test_unknown_tensor_with_expert_axis_is_reported_not_guessed(tmp_path):
    n, f, e = 64, 32, 8
    tensors = {
        "blk.0.ffn_gate_inp.weight": (e, n),
        "blk.0.ffn_up_exps.weight": (e, f, n),
        "blk.0.ffn_down_exps.weight": (e, n, f),
        "blk.0.ffn_mystery_scale.weight": (e, 4),  # unknown name, outermost dim = experts
        "blk.0.ffn_gate_exps.weight": (e, f, n),
        "blk.0.ffn_gate_shexp.weight": (e, n),  # a shared expert's gate: named, not experts
    }
    path = write_gguf(
        tmp_path / "x.gguf",
        "qwen3moe",
        tensors,
        {"qwen3moe.expert_count": e, "qwen3moe.expert_used_count": 2},
    )
    m = MoeModel(path)
    flagged = {fl.name: fl.role for fl in m.flagged}
    assert flagged == {"blk.0.ffn_mystery_scale.weight": Role.AMBIGUOUS}
    assert "blk.0.ffn_gate_shexp.weight" not in {t.name for t in m.blocks[0].tensors}
    assert len(m.ambiguous_in(0)) == 1
    m2 = MoeModel(path, assume_expert=("*mystery*",))
    assert "blk.0.ffn_mystery_scale.weight" in {t.name for t in m2.blocks[0].tensors}
    assert not m2.ambiguous_in(0)


def test_split_checkpoint_any_shard_opens_all(tmp_path):
    res = synth_model(
        tmp_path / "s.gguf", tiny_spec(layers=4, weight_type="F16"), split_max_size=60_000
    )
    assert len(res.paths) >= 3
    assert [p.name for p in res.paths][0].endswith(f"-00001-of-{len(res.paths):05d}.gguf")
    single = synth_model(tmp_path / "one.gguf", tiny_spec(layers=4, weight_type="F16")).paths[0]
    for shard in res.paths:
        m = MoeModel(shard)
        assert m.shard_paths == res.paths
        assert m.moe_block_indices == [0, 1, 2, 3]
    # same tensors and bytes as the unsplit model: same identity
    assert MoeModel(res.paths[-1]).fingerprint == MoeModel(single).fingerprint
    res.paths[1].unlink()
    with pytest.raises(BadInput, match="missing shard"):
        MoeModel(res.paths[0])


def test_fingerprint_tracks_content_and_expert_order(tmp_path):
    a = synth_model(tmp_path / "a.gguf", tiny_spec(seed=1)).paths[0]
    b = synth_model(tmp_path / "b.gguf", tiny_spec(seed=2)).paths[0]
    c = synth_model(tmp_path / "c.gguf", tiny_spec(seed=1)).paths[0]
    assert MoeModel(a).fingerprint == MoeModel(c).fingerprint
    assert MoeModel(a).fingerprint != MoeModel(b).fingerprint


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b[:100], "truncated|past the end|corrupt"),
        (lambda b: b"GGUX" + b[4:], "not a GGUF file"),
        (lambda b: b[:4] + (7).to_bytes(4, "little") + b[8:], "unsupported GGUF version 7"),
        (lambda b: b[: len(b) - 5000], "past the end of the file"),
        (lambda b: b"", "too short"),
    ],
    ids=["truncated-header", "magic", "version", "truncated-data", "empty"],
)
def test_bad_files_give_one_clear_error(tmp_path, mutate, message):
    (path,) = synth_model(tmp_path / "m.gguf", tiny_spec()).paths
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(mutate(path.read_bytes()))
    with pytest.raises(BadInput, match=message) as exc:
        MoeModel(bad)
    assert str(bad) in str(exc.value)
