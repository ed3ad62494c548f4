"""Drop-in layouts on real files: fused gate+up, pipeline order, alignment, with and without a
permutation — written as the layout placement says, verified, undone byte for byte."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from moefixtures import (
    craft_metadata,
    flip_range,
    grouped_plan,
    metadata_entries,
    run_cli,
    tiny_spec,
    write_gguf,
)
from moepack.checkpoint import MoeModel
from moepack.checkpoint.provenance import pack_kv
from moepack.checkpoint.synth import synth_model
from moepack.errors import BadInput
from moepack.layout.cost import layout_cost
from moepack.layout.layout import LayoutOptions, place
from moepack.layout.plan import LayerPlan, Plan
from moepack.rewrite.repack import repack
from moepack.rewrite.undo import undo
from moepack.rewrite.verify import verify

LAYOUTS = [
    ("fused", 0),
    ("pipeline", 0),
    ("reorder", 4096),
    ("reorder+fused", 0),
    ("fused+pipeline", 4096),
    ("reorder+fused+pipeline", 4096),
]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("layouts")
    spec = tiny_spec(arch="deepseek2", layers=3, weight_type="Q8_0", seed=3)
    return synth_model(d / "ds.gguf", spec).paths[0]


def _repack(src: Path, out: Path, layout: str, align: int, seed: int = 1) -> Path:
    with MoeModel(src) as m:
        plan = grouped_plan(m, seed) if "reorder" in layout else None
    return repack(src, plan, out, layout=layout, alignment=align).outputs[0]


@pytest.mark.parametrize("layout, align", LAYOUTS)
def test_every_layout_verifies_and_undoes_byte_for_byte(deepseek, tmp_path, layout, align):
    out = _repack(deepseek, tmp_path / "r.gguf", layout, align)
    assert out.read_bytes() != deepseek.read_bytes()
    v = verify(deepseek, out)
    assert v.ok, v.difference
    assert v.permutation_source == "provenance"
    assert v.blocks_fused == ([1, 2] if "fused" in layout else [])
    assert v.alignment == (align or 32)
    back = undo(out, tmp_path / "back.gguf").outputs[0]
    assert back.read_bytes() == deepseek.read_bytes()


def test_a_fused_slice_is_the_gate_slice_then_the_up_slice(deepseek, tmp_path):
    out = _repack(deepseek, tmp_path / "r.gguf", "reorder+fused", 0)
    perms = {lp.block: lp.perm for lp in grouped_plan(MoeModel(deepseek), 1).layers}
    orig = {t.name: np.asarray(t.data) for t in GGUFReader(deepseek).tensors}
    rep = {t.name: np.asarray(t.data) for t in GGUFReader(out).tensors}
    for b in (1, 2):
        assert f"blk.{b}.ffn_gate_exps.weight" not in rep
        gate, up = orig[f"blk.{b}.ffn_gate_exps.weight"], orig[f"blk.{b}.ffn_up_exps.weight"]
        fused = rep[f"blk.{b}.ffn_gate_up_exps.weight"]
        p = perms[b]
        assert np.array_equal(fused, np.concatenate([gate[p], up[p]], axis=1))
        assert np.array_equal(
            rep[f"blk.{b}.ffn_down_exps.weight"], orig[f"blk.{b}.ffn_down_exps.weight"][p]
        )
        assert np.array_equal(
            rep[f"blk.{b}.ffn_gate_inp.weight"], orig[f"blk.{b}.ffn_gate_inp.weight"][p]
        )


def test_pipeline_puts_each_blocks_experts_first_in_execution_order_aligned(deepseek, tmp_path):
    out = _repack(deepseek, tmp_path / "r.gguf", "fused+pipeline", 4096)
    m = MoeModel(out)
    assert m.shards[0].alignment == 4096 and m.shards[0].get("general.alignment") == 4096
    names = [t.name for t in m.shards[0].tensors]
    for b in (1, 2):
        mine = [n for n in names if n.startswith(f"blk.{b}.")]
        assert mine[:2] == [f"blk.{b}.ffn_gate_up_exps.weight", f"blk.{b}.ffn_down_exps.weight"]
        i = names.index(mine[0])
        assert names[i : i + len(mine)] == mine  # the block stays together
    offsets = [t.offset for t in m.shards[0].tensors]
    assert offsets == sorted(offsets) and all(o % 4096 == 0 for o in offsets)
    # these slices (2,176 and 4,352 bytes) cannot all be on 4 KiB: the result says so
    notes = repack(deepseek, None, tmp_path / "r2.gguf", layout="pipeline", alignment=4096).notes
    assert any(
        "6 of 6 expert matrices have slices that are not a multiple of 4096" in n for n in notes
    )


@pytest.mark.parametrize("layout", ["reorder+fused+pipeline", "reorder+fused", "pipeline"])
def test_repack_writes_what_place_describes(deepseek, tmp_path, layout):
    """One truth: each expert's slices sit in the written file where ``place`` says, up to one
    shift per block, so what ``analyse`` costs is what ``repack`` writes."""
    with MoeModel(deepseek) as m:
        plan = grouped_plan(m, 1)
        want = place(m, layout, LayoutOptions(plan=plan, alignment=4096))
    out = _repack(deepseek, tmp_path / "r.gguf", layout, 4096)
    with MoeModel(out) as r:
        have = place(r, "identity")
        for b, bp in want.blocks.items():
            hp = have.block(b)
            names = [t.name for t in hp.tensors]
            assert [
                t.name + ".weight" if not t.name.endswith(".weight") else t.name for t in bp.tensors
            ] == names
            shift = {
                int(h.offsets[bp.slot_of[e]]) - int(w.offsets[e])
                for w, h in zip(bp.tensors, hp.tensors, strict=True)
                for e in range(bp.n_expert)
            }
            assert len(shift) == 1, shift
            for w, h in zip(bp.tensors, hp.tensors, strict=True):
                assert w.slice_bytes == h.slice_bytes


@pytest.mark.parametrize("layout", ["reorder+fused+pipeline", "fused", "reorder+pipeline"])
def test_the_cost_of_a_layout_is_the_cost_of_the_file_repack_writes(deepseek, tmp_path, layout):
    """``analyse``'s numbers for a layout of the original equal those of the written file as
    it is, for the same routing (mapped to the slots the experts moved to)."""
    rng = np.random.default_rng(0)
    with MoeModel(deepseek) as m:
        plan = grouped_plan(m, 1)
        blocks = [b.index for b in m.blocks]
        ids = np.stack([[rng.choice(8, 2, replace=False) for _ in blocks] for _ in range(300)])
        want = layout_cost(place(m, layout, LayoutOptions(plan=plan, alignment=4096)), ids, blocks)
        slot_of = {b: place(m, layout, LayoutOptions(plan=plan)).block(b).slot_of for b in blocks}
        base = layout_cost(place(m, "identity"), ids, blocks)
    if "fused" in layout:  # the comparison can tell layouts apart
        assert want.requests_per_token < base.requests_per_token
    out = _repack(deepseek, tmp_path / "r.gguf", layout, 4096)
    moved = np.stack([slot_of[b][ids[:, i]] for i, b in enumerate(blocks)], axis=1)
    with MoeModel(out) as r:
        have = layout_cost(place(r, "identity"), moved, blocks)
    assert have.requests_per_token == want.requests_per_token
    assert have.bytes_per_token == want.bytes_per_token


def test_verify_discovers_layout_and_permutation_without_provenance(deepseek, tmp_path):
    out = _repack(deepseek, tmp_path / "r.gguf", "reorder+fused+pipeline", 4096)
    bare = craft_metadata(
        out,
        tmp_path / "bare.gguf",
        [raw for k, raw in metadata_entries(out) if not k.startswith("moepack.repack.")],
    )
    v = verify(deepseek, bare)
    assert v.ok, v.difference
    assert v.permutation_source == "discovered" and v.blocks_permuted == [1, 2]
    assert v.blocks_fused == [1, 2] and v.tensor_order == "changed"
    # a slice swapped between two experts of the fused tensor is named
    g = MoeModel(bare).shards[0].by_name["blk.1.ffn_gate_up_exps.weight"]
    raw = bytearray(bare.read_bytes())
    step = g.n_bytes // 8
    a, b = raw[g.offset : g.offset + step], raw[g.offset + step : g.offset + 2 * step]
    raw[g.offset : g.offset + step], raw[g.offset + step : g.offset + 2 * step] = b, a
    (tmp_path / "swapped.gguf").write_bytes(raw)
    v = verify(deepseek, tmp_path / "swapped.gguf")
    assert v.difference is not None
    assert not v.ok and v.difference.what == "data"


def test_layouts_llama_cpp_cannot_load_are_refused(tmp_path, deepseek):
    qwen = synth_model(tmp_path / "q.gguf", tiny_spec()).paths[0]
    with pytest.raises(BadInput, match="does not take a fused ffn_gate_up_exps"):
        repack(qwen, None, tmp_path / "x.gguf", layout="fused")
    with pytest.raises(BadInput, match="expert-major is a store"):
        repack(qwen, None, tmp_path / "x.gguf", layout="expert-major")
    for bad in (3000, 16):
        with pytest.raises(BadInput, match="power of two"):
            repack(qwen, None, tmp_path / "x.gguf", layout="pipeline", alignment=bad)
    out = _repack(deepseek, tmp_path / "r.gguf", "fused", 0)
    with pytest.raises(BadInput, match="already a layout rewrite"):
        repack(out, None, tmp_path / "x.gguf", layout="pipeline")
    assert not (tmp_path / "x.gguf").exists()


def test_a_layout_rewrite_can_still_be_reordered_and_undone(deepseek, tmp_path):
    out = _repack(deepseek, tmp_path / "r.gguf", "fused+pipeline", 4096)
    with MoeModel(out) as r:
        plan = grouped_plan(r, 7)
    again = repack(out, plan, tmp_path / "r2.gguf").outputs[0]
    assert verify(deepseek, again).ok  # against the very original
    assert verify(out, again).ok  # and against the layout rewrite it was made from
    assert undo(again, tmp_path / "back.gguf").outputs[0].read_bytes() == deepseek.read_bytes()


@pytest.mark.parametrize(
    "layout, split",
    [("reorder+fused+pipeline", 150_000), ("reorder", 200_000)],  # a block per shard / across
)
def test_split_in_split_out(tmp_path, layout, split):
    spec = tiny_spec(arch="deepseek2", layers=3, weight_type="Q8_0")
    src = synth_model(tmp_path / "s.gguf", spec, split_max_size=split).paths
    assert len(src) > 1
    outs = _repack(src[0], tmp_path / "o.gguf", layout, 4096)
    shards = MoeModel(outs).shard_paths
    assert len(shards) == len(src)
    assert verify(src[0], outs).ok
    back = MoeModel(undo(outs, tmp_path / "b.gguf").outputs[0]).shard_paths
    for a, b in zip(src, back, strict=True):
        assert a.read_bytes() == b.read_bytes()


def test_cli_repack_layout_and_undo(capsys, deepseek, tmp_path):
    out, back = tmp_path / "r.gguf", tmp_path / "b.gguf"
    code, text, err = run_cli(
        capsys,
        "repack",
        deepseek,
        "--layout",
        "fused+pipeline",
        "--align",
        "4096",
        "--out",
        out,
        "-q",
    )
    assert code == 0, err
    assert "layout fused+pipeline (alignment 4096)" in text and "2 blocks fused" in text
    code, text, err = run_cli(capsys, "verify", deepseek, out, "-q")
    assert code == 0 and "gate+up fused in 2 blocks" in text, err
    code, _, err = run_cli(capsys, "repack", out, "--undo", "--out", back, "-q")
    assert code == 0, err
    assert back.read_bytes() == deepseek.read_bytes()
    code, _, err = run_cli(capsys, "repack", out, "--undo", "--layout", "fused", "--out", back)
    assert code == 2 and "--undo takes no" in err


def test_every_single_byte_flip_of_a_layout_rewrite_fails(tmp_path):
    """A fused, pipelined, aligned and permuted file: every byte flipped whole fails, and so
    does every single bit of the provenance (what undo relies on)."""
    n, f, e = 16, 4, 4
    tensors = {
        "token_embd.weight": (6, n),
        "blk.0.attn_norm.weight": (n,),
        "blk.0.attn_q_a_norm.weight": (3,),  # 6 bytes: leaves padding before the next tensor
        "blk.0.ffn_gate_inp.weight": (e, n),
        "blk.0.ffn_down_exps.weight": (e, n, f),
        "blk.0.ffn_gate_exps.weight": (e, f, n),
        "blk.0.ffn_up_exps.weight": (e, f, n),
        "blk.0.exp_probs_b.bias": (e,),
        "output_norm.weight": (5,),  # the file ends in padding
    }
    kv = {
        "general.name": "flip",
        "deepseek2.expert_count": e,
        "deepseek2.expert_used_count": 2,
        "deepseek2.block_count": 1,
    }
    original = write_gguf(tmp_path / "o.gguf", "deepseek2", tensors, kv, dtype=np.float16)
    with MoeModel(original) as m:
        plan = Plan([LayerPlan(0, np.array([2, 0, 3, 1]))], m.fingerprint)
    out = repack(original, plan, tmp_path / "r.gguf", layout="fused+pipeline", alignment=64)
    repacked = out.outputs[0]
    assert verify(original, repacked).ok
    shard = MoeModel(repacked).shards[0]
    size = repacked.stat().st_size
    assert shard.data_offset > shard.header_end and size > shard.data_end
    assert "moepack.repack.order" in shard.kv and shard.alignment == 64
    prov = [v for k, v in shard.kv.items() if k.startswith("moepack.repack.")]
    first_prov, last_prov = min(v.start for v in prov), max(v.end for v in prov)
    bits = tuple(1 << b for b in range(8))
    jobs = []
    for lo, hi, masks in ((0, size, (0xFF,)), (first_prov, last_prov, bits)):
        cuts = np.linspace(lo, hi, 3, dtype=int)
        jobs += [
            (str(original), str(repacked), int(a), int(b), masks)
            for a, b in zip(cuts[:-1], cuts[1:], strict=True)
        ]
    with multiprocessing.get_context("fork").Pool(2) as pool:
        survivors = [i for part in pool.map(flip_range, jobs) for i in part]
    assert survivors == [], f"flips (offset, mask) {survivors[:10]} still verified"


def test_undo_refuses_a_provenance_that_does_not_account_for_every_tensor(deepseek, tmp_path):
    out = _repack(deepseek, tmp_path / "r.gguf", "fused", 0)
    kvs = metadata_entries(out)
    order = MoeModel(out).shards[0].get("moepack.repack.order")
    lying = [2 * (v // 2) for v in order]  # the up half of every fused tensor forgotten
    raws = [
        pack_kv(k, GGUFValueType.ARRAY, lying) if k == "moepack.repack.order" else raw
        for k, raw in kvs
    ]
    bad = craft_metadata(out, tmp_path / "bad.gguf", raws)
    with pytest.raises(BadInput, match="does not account for 'blk.1.ffn_gate_up_exps.weight'"):
        undo(bad, tmp_path / "back.gguf")
    assert not (tmp_path / "back.gguf").exists()
    v = verify(deepseek, bad)
    assert v.difference is not None
    assert not v.ok and v.difference.what == "provenance"


def test_fusing_gate_and_up_of_different_types_is_refused_with_the_types(tmp_path):
    n, f, e = 32, 8, 4
    path = tmp_path / "mixed.gguf"
    w = GGUFWriter(path, "deepseek2")
    w.add_uint32("deepseek2.expert_count", e)
    w.add_uint32("deepseek2.expert_used_count", 2)
    w.add_uint32("deepseek2.block_count", 1)
    rng = np.random.default_rng(0)
    w.add_tensor("blk.0.ffn_gate_inp.weight", rng.standard_normal((e, n)).astype(np.float32))
    w.add_tensor("blk.0.ffn_gate_exps.weight", rng.standard_normal((e, f, n)).astype(np.float16))
    w.add_tensor("blk.0.ffn_up_exps.weight", rng.standard_normal((e, f, n)).astype(np.float32))
    w.add_tensor("blk.0.ffn_down_exps.weight", rng.standard_normal((e, n, f)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(BadInput, match="gate and up differ in type or size .F16 512 B vs F32"):
        repack(path, None, tmp_path / "x.gguf", layout="fused")
    assert not (tmp_path / "x.gguf").exists()
