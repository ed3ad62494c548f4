"""Multi-token-prediction blocks: the blocks llama.cpp loads and never runs are read from the
metadata as llama.cpp reads them, shown by ``inspect``, planted with nothing, and repacked in
place or permuted as asked, verified byte for byte (llama.cpp's side: tests/llama/test_nextn)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.gguf_file import GgufFile
from moepack.checkpoint.nextn import blocks_run
from moepack.checkpoint.routing import RoutingSpec, router_blocks
from moepack.checkpoint.synth import synth_model
from moepack.errors import BadInput
from moepack.layout.coactivation_plan import plan_from_trace
from moepack.layout.plan import LayerPlan, Plan
from moepack.rewrite.repack import repack
from moepack.rewrite.verify import verify
from moepack.trace.core import RoutingTrace

GLM = dict(arch="glm4moe", layers=4, experts=8, top_k=2)  # blocks: 0 dense, 1-2 MoE, 3 MTP


def test_llama_cpp_runs_the_blocks_before_the_nextn_ones():
    assert blocks_run("glm4moe", 47, 1, ()) == 46  # GLM-4.5-Air: 46 layers + 1 MTP block
    assert blocks_run("deepseek2", 62, 1, ()) == 61  # DeepSeek-V3: 61 + 1
    assert blocks_run("qwen3moe", 48, 0, ()) == 48
    assert blocks_run("qwen3moe", 4, 9, ()) == 0  # more than the blocks: llama.cpp refuses
    # deepseek4 takes the count back when the first MTP block has no nextn.eh_proj
    assert blocks_run("deepseek4", 44, 1, ()) == 44
    assert blocks_run("deepseek4", 44, 1, {"blk.43.nextn.eh_proj.weight"}) == 43


def test_glm4moe_has_an_mtp_block_the_model_says_is_not_run(tmp_path):
    path = synth_model(tmp_path / "g.gguf", tiny_spec(**GLM)).paths[0]
    g = GgufFile(path)
    assert g.get("glm4moe.nextn_predict_layers") == 1
    assert g.get("glm4moe.leading_dense_block_count") == 1
    names = {t.name for t in g.tensors}
    assert {f"blk.3.nextn.{t}.weight" for t in ("eh_proj", "enorm", "hnorm")} <= names
    assert not any(n.startswith("blk.2.nextn.") for n in names)
    m = MoeModel(path)
    assert m.moe_block_indices == [1, 2, 3] and not m.flagged
    assert m.run_block_indices == [1, 2] and m.not_run_block_indices == [3]
    assert m.block_count == 4 and m.blocks_run == 3 and m.nextn_layers == 1


def test_deepseek2_takes_nextn_layers_and_other_families_refuse_them(tmp_path):
    spec = tiny_spec(arch="deepseek2", layers=3, nextn_layers=1)
    m = MoeModel(synth_model(tmp_path / "d.gguf", spec).paths[0])
    assert m.run_block_indices == [1] and m.not_run_block_indices == [2]
    assert "blk.2.nextn.eh_proj.weight" in m.tensors
    with pytest.raises(BadInput, match="nextn-layers is not an option of qwen3moe"):
        synth_model(tmp_path / "q.gguf", tiny_spec(nextn_layers=1))
    with pytest.raises(BadInput, match="at least one MoE layer that runs"):
        synth_model(tmp_path / "g.gguf", tiny_spec(**{**GLM, "layers": 2, "dense_layers": 1}))
    with pytest.raises(BadInput, match="at least one MoE layer that runs"):
        synth_model(tmp_path / "d2.gguf", tiny_spec(arch="deepseek2", layers=2, nextn_layers=1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.gguf"]


def test_inspect_shows_the_block_llama_cpp_never_runs(tmp_path, capsys):
    path = synth_model(tmp_path / "g.gguf", tiny_spec(**GLM)).paths[0]
    code, out, err = run_cli(capsys, "inspect", path, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["nextn_layers"] == 1 and doc["not_run_blocks"] == [3]
    assert [(x["block"], x["runs"]) for x in doc["layers"]] == [(1, True), (2, True), (3, False)]
    code, out, err = run_cli(capsys, "inspect", path)
    assert code == 0, err
    assert "3 (not run)" in out and "block 3: next-token prediction (MTP)" in out
    plain = synth_model(tmp_path / "q.gguf", tiny_spec()).paths[0]
    code, out, _ = run_cli(capsys, "inspect", plain, "--json")
    assert json.loads(out)["not_run_blocks"] == [] and "not run" not in out


def test_planted_routing_leaves_the_mtp_block_alone():
    spec = tiny_spec(**GLM, vocab=300, routing=RoutingSpec(cluster_size=2))
    assert router_blocks(spec) == (1, 2)


def _trace(m: MoeModel, blocks: list[int], tokens: int = 400) -> RoutingTrace:
    rng = np.random.default_rng(3)
    ids = np.stack([rng.permutation(m.n_expert)[:2] for _ in range(tokens * len(blocks))])
    return RoutingTrace(
        ids=ids.reshape(tokens, len(blocks), 2).astype(np.uint8),
        n_expert=m.n_expert,
        block_map=blocks,
        model_fingerprint=m.fingerprint,
    )


def test_a_trace_of_the_blocks_that_run_plans_them_and_leaves_the_mtp_block(tmp_path):
    path = synth_model(tmp_path / "g.gguf", tiny_spec(**GLM)).paths[0]
    m = MoeModel(path)
    trace = _trace(m, m.run_block_indices)
    assert trace.replace(block_map=None).resolved_block_map(m) == [1, 2]  # what a capture has
    plan = plan_from_trace(m, trace).plan
    assert {lp.block for lp in plan.layers} <= {1, 2}
    out = repack(path, plan, tmp_path / "r.gguf").outputs[0]
    v = verify(path, out)
    assert v.ok and 3 not in v.blocks_permuted
    with MoeModel(out) as r:
        for t in m.block(3).tensors:
            a = m.shards[t.shard].reader.data[t.entry.offset : t.entry.end]
            b = r.tensors[t.name]
            assert np.array_equal(a, r.shards[0].reader.data[b.offset : b.offset + b.n_bytes])


def test_the_mtp_block_is_permuted_when_the_plan_asks_and_verified_byte_for_byte(tmp_path):
    path = synth_model(tmp_path / "g.gguf", tiny_spec(**GLM)).paths[0]
    m = MoeModel(path)
    perm = np.random.default_rng(5).permutation(m.n_expert)
    plan = Plan([LayerPlan(3, perm)], m.fingerprint)
    out = repack(path, plan, tmp_path / "r.gguf", keep_header=True).outputs[0]
    v = verify(path, out)  # no provenance: the permutation is found from the slices
    assert v.ok and v.permutation_source == "discovered" and v.blocks_permuted == [3]
    assert v.permutations == {3: perm.tolist()}
    broken = bytearray(out.read_bytes())
    t = next(x for x in m.block(3).tensors if x.kind == "down")
    broken[t.slice_offset(0) + 5] ^= 0x10  # one byte of one MTP expert
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(broken))
    assert not verify(path, bad).ok


def test_analyse_needs_no_routing_of_a_block_nothing_reads(tmp_path):
    from moepack.layout.analyse import covered_blocks

    path = synth_model(tmp_path / "g.gguf", tiny_spec(**GLM)).paths[0]
    m = MoeModel(path)
    assert covered_blocks(m, _trace(m, [1, 2])) == [1, 2]
    with pytest.raises(BadInput, match="not covered: 2"):
        covered_blocks(m, _trace(m, [1]))
