"""llama.cpp judges grouped routing: a DeepSeek-V3-style model (synthetic ``deepseek2`` with
routing groups) planned and repacked by moepack gives the same logits; the same model with
experts moved across groups does not — and moepack refuses to write it and fails to verify it.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from moepack.checkpoint import MoeModel
from moepack.checkpoint.synth import SynthSpec, synth_model
from moepack.errors import BadInput
from moepack.layout.coactivation_plan import plan_from_trace
from moepack.layout.plan import LayerPlan, Plan
from moepack.rewrite.repack import repack
from moepack.rewrite.verify import verify
from moepack.trace.synth import synth_trace

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    d = tmp_path_factory.mktemp("grouped")
    spec = SynthSpec(arch="deepseek2", layers=3, experts=16, top_k=4, seed=5)
    path = synth_model(d / "ds.gguf", spec).paths[0]
    with MoeModel(path) as m:
        assert m.n_expert_group == 4 and 0 < m.n_expert_group_used < 4
        assert all(b.constraints[0].kind == "grouped-routing" for b in m.blocks)
    return path


@pytest.mark.parametrize("order_groups", [True, False], ids=["groups-ordered", "within-only"])
def test_planned_repack_of_a_grouped_model_gives_the_same_logits(grouped, tmp_path, order_groups):
    from moepack.llama.judge.judge import judge

    with MoeModel(grouped) as m:
        trace = synth_trace(m, tokens=2048, seed=2)
        outcome = plan_from_trace(m, trace, order_groups=order_groups)
    assert any(x.changed for x in outcome.layers)
    out = repack(grouped, outcome.plan, tmp_path / "r.gguf").outputs[0]
    assert verify(grouped, out).ok
    r = judge(grouped, out, tolerance=1e-4)
    assert r.ok, r


def _moved_across_groups(model, out, seed: int):
    """``model`` with every MoE block's experts freely permuted, written byte by byte (what a
    group-blind tool writes); returns the path and the permutations."""
    shutil.copy(model, out)
    perms = {}
    rng = np.random.default_rng(seed)
    with MoeModel(model) as m, open(out, "r+b") as fh:
        for b in m.blocks:
            perm = rng.permutation(b.n_expert)
            while b.violation(perm) is None:
                perm = rng.permutation(b.n_expert)
            perms[b.index] = perm
            for t in b.tensors:
                s = t.slice_bytes
                src = np.asarray(m.shards[t.shard].reader.data[t.entry.offset : t.entry.end])
                fh.seek(t.entry.offset)
                fh.write(b"".join(src[e * s : (e + 1) * s].tobytes() for e in perm))
    return out, perms


def test_experts_moved_across_groups_change_llama_cpp_and_are_refused(grouped, tmp_path):
    from moepack.llama.judge.judge import judge

    bad, perms = _moved_across_groups(grouped, tmp_path / "bad.gguf", seed=4)
    r = judge(grouped, bad, tolerance=1e-4)
    assert not r.ok and r.max_abs_diff > 1e-2, r  # the rule is real: llama.cpp computes otherwise
    v = verify(grouped, bad)
    assert v.difference is not None
    assert not v.ok and v.difference.what == "expert-index"
    with MoeModel(grouped) as m:
        plan = Plan([LayerPlan(b, p) for b, p in perms.items()], m.fingerprint)
    with pytest.raises(BadInput, match=r"block \d+: the plan would change what llama.cpp computes"):
        repack(grouped, plan, tmp_path / "r.gguf")
    assert not (tmp_path / "r.gguf").exists()
