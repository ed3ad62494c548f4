"""Repack and verify on real files: permutations, provenance, round trips, split, plans."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from moefixtures import ambiguous_model, tiny_spec, write_gguf
from moepack.checkpoint import MoeModel
from moepack.checkpoint.provenance import read_provenance
from moepack.checkpoint.synth import synth_model
from moepack.errors import BadInput
from moepack.layout.plan import LayerPlan, Plan, load_plan, save_plan
from moepack.rewrite.repack import repack
from moepack.rewrite.verify import verify


def random_plan(model_path, seed=0, blocks=None) -> Plan:
    m = MoeModel(model_path)
    rng = np.random.default_rng(seed)
    layers = [
        LayerPlan(b.index, rng.permutation(b.n_expert))
        for b in m.blocks
        if blocks is None or b.index in blocks
    ]
    return Plan(layers, m.fingerprint, str(model_path), source="test")


@pytest.fixture
def model(tmp_path):
    return synth_model(tmp_path / "m.gguf", tiny_spec(layers=3)).paths[0]


def test_repack_permutes_every_expert_axis_tensor_with_one_permutation(tmp_path, model):
    plan = random_plan(model, seed=3)
    res = repack(model, plan, tmp_path / "r.gguf")
    assert res.blocks_permuted == [0, 1, 2] and res.tensors_permuted == 12
    orig, out = GGUFReader(model), GGUFReader(tmp_path / "r.gguf")
    ot = {t.name: np.asarray(t.data) for t in orig.tensors}
    rt = {t.name: np.asarray(t.data) for t in out.tensors}
    assert list(ot) == list(rt)
    for name, data in ot.items():
        if ".ffn_gate_inp." in name or "_exps" in name:
            b = int(name.split(".")[1])
            perm = plan.perm_for(b)
            assert np.array_equal(rt[name], data[perm]), name  # outermost numpy axis = experts
            assert not np.array_equal(rt[name], data)
        else:
            assert np.array_equal(rt[name], data), name
    # metadata preserved; provenance recorded
    for key, field in orig.fields.items():
        if key.startswith("GGUF."):
            continue
        assert out.fields[key].contents() == field.contents()
    prov = read_provenance(MoeModel(tmp_path / "r.gguf"))
    assert prov is not None and prov.original_fingerprint == MoeModel(model).fingerprint
    for lp in plan.layers:
        assert np.array_equal(prov.perms[lp.block], lp.perm)
    v = verify(model, tmp_path / "r.gguf")
    assert v.ok and v.permutation_source == "provenance" and v.tensors_permuted == 12


def test_inverse_plan_restores_the_original_byte_for_byte(tmp_path, model):
    plan = random_plan(model, seed=5)
    repack(model, plan, tmp_path / "r.gguf")
    repack(tmp_path / "r.gguf", plan.inverse(), tmp_path / "back.gguf")
    assert (tmp_path / "back.gguf").read_bytes() == model.read_bytes()


def test_repacking_twice_composes_provenance(tmp_path, model):
    p1, p2 = random_plan(model, seed=1), random_plan(model, seed=2)
    repack(model, p1, tmp_path / "r1.gguf")
    p2.model_fingerprint = MoeModel(tmp_path / "r1.gguf").fingerprint
    repack(tmp_path / "r1.gguf", p2, tmp_path / "r2.gguf")
    prov = read_provenance(MoeModel(tmp_path / "r2.gguf"))
    for b in (0, 1, 2):
        first, second = p1.perm_for(b), p2.perm_for(b)
        assert prov is not None and first is not None and second is not None
        assert np.array_equal(prov.perms[b], first[second])
    assert verify(model, tmp_path / "r2.gguf").ok  # against the very original
    assert verify(tmp_path / "r1.gguf", tmp_path / "r2.gguf").ok  # and against the middle one
    assert verify(tmp_path / "r1.gguf", tmp_path / "r2.gguf", plan=p2).ok


def test_keep_header_and_discovery(tmp_path, model):
    plan = random_plan(model, seed=7, blocks={0, 2})
    repack(model, plan, tmp_path / "r.gguf", keep_header=True)
    out = (tmp_path / "r.gguf").read_bytes()
    m = MoeModel(model)
    head = m.shards[0].data_offset
    assert out[:head] == model.read_bytes()[:head]
    v = verify(model, tmp_path / "r.gguf")
    assert v.ok and v.permutation_source == "discovered" and v.blocks_permuted == [0, 2]
    assert verify(model, tmp_path / "r.gguf", plan=plan).ok
    wrong = random_plan(model, seed=8, blocks={0, 2})
    v = verify(model, tmp_path / "r.gguf", plan=wrong)
    assert v.difference is not None
    assert not v.ok and v.difference.what == "data" and v.difference.slot is not None


def test_discovery_handles_identical_experts(tmp_path):
    """Two experts with the same bytes: discovery must still find a consistent assignment."""
    n, f, e = 32, 32, 4
    path = write_gguf(
        tmp_path / "d.gguf",
        "qwen3moe",
        {
            "blk.0.ffn_gate_inp.weight": (e, n),
            "blk.0.ffn_up_exps.weight": (e, f, n),
            "blk.0.ffn_down_exps.weight": (e, n, f),
        },
        {"qwen3moe.expert_count": e, "qwen3moe.expert_used_count": 2},
    )
    raw = bytearray(path.read_bytes())
    m = MoeModel(path)
    for t in m.blocks[0].tensors:  # make expert 3 a copy of expert 1 in every tensor
        s = t.slice_bytes
        raw[t.slice_offset(3) : t.slice_offset(3) + s] = raw[
            t.slice_offset(1) : t.slice_offset(1) + s
        ]
    path.write_bytes(bytes(raw))
    plan = Plan([LayerPlan(0, np.array([3, 2, 1, 0]))], MoeModel(path).fingerprint)
    repack(path, plan, tmp_path / "r.gguf", keep_header=True)
    assert verify(path, tmp_path / "r.gguf").ok


def test_split_in_split_out(tmp_path):
    res = synth_model(
        tmp_path / "s.gguf", tiny_spec(layers=4, weight_type="Q8_0"), split_max_size=40_000
    )
    n = len(res.paths)
    assert n >= 2
    plan = random_plan(res.paths[0], seed=11)
    out = repack(res.paths[1], plan, tmp_path / "out.gguf")
    assert [p.name for p in out.outputs] == [
        f"out-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)
    ]
    v = verify(res.paths[0], out.outputs[-1])
    assert v.ok and v.blocks_permuted == [0, 1, 2, 3]
    back = repack(out.outputs[0], plan.inverse(), tmp_path / "back.gguf")
    for a, b in zip(res.paths, back.outputs, strict=True):
        assert a.read_bytes() == b.read_bytes()


def test_pmxplan_round_trip_and_use(tmp_path, model):
    plan = random_plan(model, seed=4)
    plan.layers[0].tensors = [t.name for t in MoeModel(model).blocks[0].tensors]
    save_plan(plan, tmp_path / "p.pmxplan")
    text = (tmp_path / "p.pmxplan").read_text()
    assert text.startswith("pmxplan 1\n") and "perm " in text and "tensors blk.0." in text
    back = load_plan(tmp_path / "p.pmxplan")
    assert back.model_fingerprint is None
    for a, b in zip(plan.layers, back.layers, strict=True):
        assert a.block == b.block and np.array_equal(a.perm, b.perm)
    save_plan(plan, tmp_path / "p.moeplan")
    native = load_plan(tmp_path / "p.moeplan")
    assert native.model_fingerprint == plan.model_fingerprint
    r1 = repack(model, back, tmp_path / "a.gguf")
    r2 = repack(model, native, tmp_path / "b.gguf")
    assert r1.outputs[0].read_bytes() == r2.outputs[0].read_bytes()


@pytest.mark.parametrize(
    "layers, message",
    [
        ([LayerPlan(9, np.arange(8))], "block 9 is not a MoE block"),
        ([LayerPlan(0, np.array([0, 1, 2, 3, 4, 5, 6, 6]))], "not a permutation"),
        ([LayerPlan(0, np.arange(7))], "has 7 entries"),
        ([LayerPlan(0, np.arange(8)), LayerPlan(0, np.arange(8))], "appears twice"),
        ([LayerPlan(0, np.arange(8), ["blk.0.attn_q.weight"])], "not an expert-axis tensor"),
    ],
)
def test_bad_plans_are_refused(tmp_path, model, layers, message):
    with pytest.raises(BadInput, match=message):
        repack(model, Plan(layers, None), tmp_path / "r.gguf")
    assert not list(tmp_path.glob("r.gguf*")) and not list(tmp_path.glob(".r.gguf*"))


def test_plan_for_another_model_is_refused(tmp_path, model):
    other = synth_model(tmp_path / "o.gguf", tiny_spec(layers=3, seed=9)).paths[0]
    with pytest.raises(BadInput, match="plan is for another model"):
        repack(model, random_plan(other), tmp_path / "r.gguf")


def test_ambiguous_block_refuses_to_guess(tmp_path):
    path = ambiguous_model(tmp_path / "x.gguf")
    plan = Plan([LayerPlan(0, np.array([1, 0, 3, 2]))], None)
    with pytest.raises(BadInput, match="cannot classify"):
        repack(path, plan, tmp_path / "r.gguf")
    # declared, it is permuted with the block, and verify expects exactly that
    res = repack(path, plan, tmp_path / "r.gguf", assume_expert=("*ffn_odd*",))
    assert res.tensors_permuted == 4
    assert verify(path, tmp_path / "r.gguf", assume_expert=("*ffn_odd*",)).ok
    # undeclared, verify will not pass a file where the unknown tensor moved
    v = verify(path, tmp_path / "r.gguf")
    assert v.difference is not None
    assert not v.ok and v.difference.tensor == "blk.0.ffn_odd.weight"
