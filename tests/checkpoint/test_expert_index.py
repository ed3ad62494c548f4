"""Where llama.cpp reads expert indices: grouped routing, chunk experts, token -> expert tables.

Metadata-level and byte-level checks on real GGUF files written with gguf-py; the llama.cpp
judgement of a grouped model is in test_llama_judge.py."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from gguf import GGUFReader

from moefixtures import run_cli, write_gguf
from moepack.checkpoint import MoeModel
from moepack.checkpoint.expert_index import IndexConstraint, PlanningUnits, planning_units
from moepack.checkpoint.inspect import inspect_model
from moepack.errors import BadInput
from moepack.layout.coactivation_plan import constrained_chain, plan_from_trace
from moepack.layout.plan import LayerPlan, Plan, save_plan
from moepack.rewrite.repack import repack
from moepack.rewrite.verify import verify
from moepack.trace.synth import synth_trace

E, N, F = 16, 32, 32  # experts, hidden, expert ffn


def grouped_model(path, groups=4, used=2, arch="deepseek2", extra=None, kv=None):
    """A two-block MoE model with DeepSeek-V3-style routing groups (``groups`` of E/groups)."""
    tensors: dict[str, tuple[int, ...]] = {}
    for b in range(2):
        tensors |= {
            f"blk.{b}.ffn_gate_inp.weight": (E, N),
            f"blk.{b}.ffn_gate_exps.weight": (E, F, N),
            f"blk.{b}.ffn_up_exps.weight": (E, F, N),
            f"blk.{b}.ffn_down_exps.weight": (E, N, F),
            f"blk.{b}.exp_probs_b.bias": (E,),
        }
    tensors |= extra or {}
    meta = {f"{arch}.expert_count": E, f"{arch}.expert_used_count": 2, f"{arch}.block_count": 2}
    if groups:
        meta |= {f"{arch}.expert_group_count": groups, f"{arch}.expert_group_used_count": used}
    return write_gguf(path, arch, tensors, meta | (kv or {}))


def plan_for(model, perms: dict[int, list[int]]) -> Plan:
    m = MoeModel(model)
    return Plan([LayerPlan(b, np.asarray(p)) for b, p in perms.items()], m.fingerprint)


WITHIN = [1, 0, 3, 2, 7, 6, 5, 4, 8, 9, 10, 11, 15, 14, 13, 12]  # inside each group of 4
WHOLE = [12, 13, 14, 15, 8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6, 7]  # groups 3,2,0,1
BOTH = [13, 12, 15, 14, 4, 5, 6, 7, 3, 2, 1, 0, 8, 9, 10, 11]
ACROSS = [0, 1, 2, 4, 3, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]  # swaps experts 3 and 4


# ------------------------------------------------------------------ the rule itself
def test_grouped_routing_allows_moves_within_groups_and_of_whole_groups():
    c = IndexConstraint("grouped-routing", 4, True, "4 groups")
    for ok in (WITHIN, WHOLE, BOTH, list(range(E))):
        assert c.violation(np.asarray(ok)) is None
    why = c.violation(np.asarray(ACROSS))
    assert why is not None and "expert 4 is in group 1" in why and "slots 0-3" in why


def test_fixed_groups_refuse_whole_group_moves_and_a_fixed_prefix_stays():
    c = IndexConstraint("chunk-experts", 4, False, "chunks", fixed=4)
    assert c.violation(np.asarray([0, 1, 2, 3, 5, 4, 7, 6] + list(range(8, 16)))) is None
    assert "where only expert 0 may stay" in (c.violation(np.asarray(WHOLE)) or "")
    unfixed = IndexConstraint("chunk-experts", 4, False, "chunks")
    assert "groups may not trade places" in (unfixed.violation(np.asarray(WHOLE)) or "")
    assert "slot 0" in (c.violation(np.asarray(WITHIN)) or "")  # expert 1 into slot 0: fixed


def test_planning_units_combine_rules_into_the_finest_structure():
    a = IndexConstraint("grouped-routing", 8, True, "a", groups_used=2)
    b = IndexConstraint("chunk-experts", 4, False, "b", fixed=4)
    assert planning_units([a], 32) == PlanningUnits(8, True, 0, 2)
    u = planning_units([a, b], 32)
    assert (u.size, u.movable, u.fixed) == (4, False, 4)
    frozen = IndexConstraint("token-table", 1, False, "t")
    assert planning_units([a, frozen], 32).fixed == 32


def test_constrained_chain_keeps_every_rule_on_random_co_activation():
    rng = np.random.default_rng(1)
    for rule in (
        IndexConstraint("grouped-routing", 4, True, "g", groups_used=2),
        IndexConstraint("chunk-experts", 4, False, "c", fixed=4),
    ):
        for _ in range(20):
            coact = rng.integers(0, 50, (E, E))
            coact = coact + coact.T
            perm = constrained_chain(coact, rng.integers(1, 99, E), 2, planning_units([rule], E))
            assert sorted(perm.tolist()) == list(range(E))
            assert rule.violation(perm) is None


# ------------------------------------------------------------------ model, inspect
def test_inspect_shows_routing_groups(tmp_path, capsys):
    model = grouped_model(tmp_path / "g.gguf")
    r = inspect_model(model)
    assert (r.expert_groups, r.expert_groups_used) == (4, 2)
    assert [c["kind"] for c in r.layers[0].constraints] == ["grouped-routing"]
    assert r.layers[0].constraints[0]["group_size"] == 4
    code, out, _ = run_cli(capsys, "inspect", model)
    assert code == 0 and "routing groups" in out and "grouped-routing" in out
    code, out, _ = run_cli(capsys, "inspect", model, "--json")
    assert json.loads(out)["layers"][1]["constraints"][0]["movable"] is True


def test_all_groups_used_is_still_grouped_routing_in_llama_cpp(tmp_path):
    # llama.cpp applies group selection whenever expert_group_count > 1 (it refuses files with
    # used >= count); a model without the keys has no rule
    assert MoeModel(grouped_model(tmp_path / "a.gguf", groups=4, used=1)).blocks[0].constraints
    assert not MoeModel(grouped_model(tmp_path / "b.gguf", groups=0)).blocks[0].constraints
    assert not MoeModel(grouped_model(tmp_path / "c.gguf", groups=1)).blocks[0].constraints


def test_indivisible_groups_keep_the_order(tmp_path):
    m = MoeModel(grouped_model(tmp_path / "g.gguf", groups=3, used=1))
    assert m.blocks[0].constraints[0].kind == "indivisible-groups"
    assert m.blocks[0].violation(np.asarray(WITHIN)) is not None


def test_grovemoe_chunk_experts_fix_a_prefix_and_the_chunk_groups(tmp_path):
    extra = {
        f"blk.{b}.{t}_chexps.weight": shape
        for b in range(2)
        for t, shape in (("ffn_gate", (4, 8, N)), ("ffn_up", (4, 8, N)), ("ffn_down", (4, N, 8)))
    }
    kv = {"grovemoe.experts_per_group": 4}
    model = grouped_model(tmp_path / "g.gguf", groups=0, arch="grovemoe", extra=extra, kv=kv)
    block = MoeModel(model).blocks[0]
    assert [c.kind for c in block.constraints] == ["chunk-experts"]
    assert block.constraints[0].fixed == 4
    with pytest.raises(BadInput, match="block 0: .*slot 0"):
        repack(model, plan_for(model, {0: WITHIN}), tmp_path / "r.gguf")
    ok = [0, 1, 2, 3, 5, 4, 7, 6, 11, 10, 9, 8, 12, 13, 15, 14]
    repack(model, plan_for(model, {0: ok}), tmp_path / "r.gguf")
    assert verify(model, tmp_path / "r.gguf").ok


def test_token_to_expert_table_freezes_the_block(tmp_path):
    extra = {"blk.0.ffn_gate_tid2eid.weight": (64, 2)}
    model = grouped_model(tmp_path / "g.gguf", groups=0, arch="deepseek4", extra=extra)
    m = MoeModel(model)
    assert [c.kind for c in m.block(0).constraints] == ["token-table"]
    assert not m.block(1).constraints
    with pytest.raises(BadInput, match="block 0: .*ffn_gate_tid2eid"):
        repack(model, plan_for(model, {0: WITHIN}), tmp_path / "r.gguf")
    repack(model, plan_for(model, {1: ACROSS}), tmp_path / "r.gguf")
    assert verify(model, tmp_path / "r.gguf").ok


# ------------------------------------------------------------------ repack, verify
@pytest.mark.parametrize("perm", [WITHIN, WHOLE, BOTH], ids=["within", "whole", "both"])
def test_repack_allows_group_preserving_plans(tmp_path, perm):
    model = grouped_model(tmp_path / "g.gguf")
    res = repack(model, plan_for(model, {0: perm, 1: perm}), tmp_path / "r.gguf")
    assert res.blocks_permuted == [0, 1]
    v = verify(model, tmp_path / "r.gguf")
    assert v.ok and v.blocks_permuted == [0, 1]
    rt = {t.name: np.asarray(t.data) for t in GGUFReader(tmp_path / "r.gguf").tensors}
    ot = {t.name: np.asarray(t.data) for t in GGUFReader(model).tensors}
    assert np.array_equal(rt["blk.1.exp_probs_b.bias"], ot["blk.1.exp_probs_b.bias"][perm])


def test_repack_refuses_a_plan_that_moves_an_expert_across_groups(tmp_path, capsys):
    model = grouped_model(tmp_path / "g.gguf")
    plan = plan_for(model, {0: WITHIN, 1: ACROSS})
    save_plan(plan, tmp_path / "p.moeplan")
    before = model.read_bytes()
    with pytest.raises(BadInput, match=r"block 1: .*expert 4 is in group 1"):
        repack(model, plan, tmp_path / "r.gguf")
    code, _, err = run_cli(
        capsys, "repack", model, "--plan", tmp_path / "p.moeplan", "--out", tmp_path / "r.gguf"
    )
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "p.moeplan" in err and "block 1" in err and "groups 0, 1" in err
    assert not (tmp_path / "r.gguf").exists() and model.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.gguf", "p.moeplan"]


def _permute_bytes(model, out, block, perm):
    """``model`` with one block's expert slices moved by hand (no provenance, no checks)."""
    shutil.copy(model, out)
    m = MoeModel(model)
    raw = bytearray(model.read_bytes())
    for t in m.block(block).tensors:
        src = bytes(raw[t.entry.offset : t.entry.end])
        for slot, e in enumerate(perm):
            s = t.slice_bytes
            raw[t.slice_offset(slot) : t.slice_offset(slot) + s] = src[e * s : (e + 1) * s]
    out.write_bytes(bytes(raw))
    return out


def test_verify_fails_on_experts_moved_across_groups(tmp_path, capsys):
    model = grouped_model(tmp_path / "g.gguf")
    bad = _permute_bytes(model, tmp_path / "bad.gguf", 1, ACROSS)
    v = verify(model, bad)
    assert v.difference is not None
    assert not v.ok and v.difference.what == "expert-index"
    assert "block 1" in v.difference.message and "expert 4" in v.difference.message
    code, out, err = run_cli(capsys, "verify", model, bad)
    assert code == 1 and "block 1" in out + err
    good = _permute_bytes(model, tmp_path / "good.gguf", 1, BOTH)
    assert verify(model, good).ok


def test_verify_with_a_plan_fails_on_a_cross_group_plan(tmp_path):
    model = grouped_model(tmp_path / "g.gguf")
    bad = _permute_bytes(model, tmp_path / "bad.gguf", 0, ACROSS)
    v = verify(model, bad, plan=plan_for(model, {0: ACROSS}))
    assert v.difference is not None
    assert not v.ok and v.difference.what == "expert-index"


# ------------------------------------------------------------------ planner
@pytest.mark.parametrize("order_groups", [True, False])
def test_planner_plans_within_groups(tmp_path, order_groups):
    model = grouped_model(tmp_path / "g.gguf")
    with MoeModel(model) as m:
        trace = synth_trace(m, tokens=2048, seed=3)
        outcome = plan_from_trace(m, trace, order_groups=order_groups)
        for lp in outcome.plan.layers:
            assert m.block(lp.block).violation(lp.perm) is None
            if not order_groups:
                assert np.array_equal(lp.perm // 4, np.arange(E) // 4)
    assert any(x.changed for x in outcome.layers)
    repack(model, outcome.plan, tmp_path / "r.gguf")
    assert verify(model, tmp_path / "r.gguf").ok
