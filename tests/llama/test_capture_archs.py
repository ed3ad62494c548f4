"""Capture and check-dropin on every synthetic family, with no per-architecture code: dense
leading blocks stay out of the block map, a repack maps back, an honest repack passes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from moefixtures import run_cli
from moepack.checkpoint import MoeModel
from moepack.checkpoint.archs import arch_names
from moepack.checkpoint.provenance import read_provenance
from moepack.checkpoint.synth import SynthSpec, synth_model
from moepack.errors import BadInput
from moepack.layout.plan import LayerPlan, Plan
from moepack.llama.runtime.capture import CaptureOptions, capture_trace
from moepack.llama.runtime.prompts import Prompt
from moepack.rewrite.repack import repack
from moepack.trace import load_trace

pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
pytestmark = pytest.mark.slow

SIZES = dict(
    layers=3, experts=8, top_k=2, hidden=64, expert_ffn=32, heads=2, kv_heads=1, head_dim=32
)
CASES = [(a, False) for a in arch_names()] + [("deepseek2", True)]
PROMPTS = [Prompt(text="routing through every family of experts"), Prompt(text="a b c d e f")]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c[0] + ("-fused" if c[1] else ""))
def family(request, tmp_path_factory) -> tuple[Path, Path]:
    arch, fused = request.param
    d = tmp_path_factory.mktemp(arch)
    spec = SynthSpec(**SIZES, vocab=262, arch=arch, seed=2, fused_gate_up=fused)  # type: ignore[arg-type]
    original = synth_model(d / "m.gguf", spec).paths[0]
    m = MoeModel(original)
    rng = np.random.default_rng(3)
    # grouped routing (deepseek2) picks groups by position: permute inside each group only
    groups = int(m.shards[0].get_int(f"{arch}.expert_group_count", 1) or 1)

    def perm(n: int) -> np.ndarray:
        size = n // groups
        return np.concatenate([g * size + rng.permutation(size) for g in range(groups)])

    plan = Plan([LayerPlan(b.index, perm(b.n_expert)) for b in m.blocks], m.fingerprint)
    return original, repack(original, plan, d / "r.gguf").outputs[0]


def test_capture_maps_back_through_the_repack(family, tmp_path):
    original, candidate = family
    options = CaptureOptions(n_predict=3)
    capture_trace(original, tmp_path / "a.moetrace", PROMPTS, options)
    capture_trace(candidate, tmp_path / "b.moetrace", PROMPTS, options)
    a, b = load_trace(tmp_path / "a.moetrace"), load_trace(tmp_path / "b.moetrace")
    m = MoeModel(original)
    # dense leading blocks are not trace layers, nor is glm4moe's MTP block (never run)
    assert a.block_map == m.run_block_indices
    assert a.check_against(m) == m.run_block_indices
    if not m.not_run_block_indices:
        assert a.block_map == m.moe_block_indices
        assert a.check_against(m) == m.moe_block_indices
    else:
        assert m.architecture == "glm4moe" and m.not_run_block_indices == [2]
    assert np.isfinite(np.asarray(a.weights)).all()
    prov = read_provenance(MoeModel(candidate))
    assert prov is not None
    for layer, block in enumerate(b.block_map or []):
        mapped = prov.perm(block, m.n_expert)[np.asarray(b.ids[:, layer])]
        np.testing.assert_array_equal(mapped, np.asarray(a.ids[:, layer]))


def test_check_dropin_passes_an_honest_repack(family, capsys):
    original, candidate = family
    code, out, err = run_cli(capsys, "check-dropin", original, candidate, "--json", "-q")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["verdict"] == "PASS", doc


def test_moving_experts_across_routing_groups_fails_check_dropin(tmp_path, capsys):
    """deepseek2's grouped routing picks groups by position: repack refuses a permutation
    across groups, and a file written that way by a group-blind tool fails check-dropin."""
    spec = SynthSpec(**SIZES, vocab=262, arch="deepseek2", seed=2)  # type: ignore[arg-type]
    original = synth_model(tmp_path / "m.gguf", spec).paths[0]
    swap = np.roll(np.arange(spec.experts), 1)  # every group now holds experts of two groups
    candidate = tmp_path / "r.gguf"
    with MoeModel(original) as m:
        plan = Plan([LayerPlan(b.index, swap) for b in m.blocks], m.fingerprint)
        with pytest.raises(BadInput, match="the plan would change what llama.cpp computes"):
            repack(original, plan, candidate)
        assert not candidate.exists()
        shutil.copy(original, candidate)  # what a group-blind tool writes, byte by byte
        with open(candidate, "r+b") as fh:
            for b in m.blocks:
                for t in b.tensors:
                    s = t.slice_bytes
                    src = np.asarray(m.shards[t.shard].reader.data[t.entry.offset : t.entry.end])
                    fh.seek(t.entry.offset)
                    fh.write(b"".join(src[e * s : (e + 1) * s].tobytes() for e in swap))
    code, out, _ = run_cli(capsys, "check-dropin", original, candidate, "--json", "-q")
    gates = {g["gate"]: g for g in json.loads(out)["gates"]}
    assert code == 1
    assert gates["control"]["ok"]
    assert not gates["bytes"]["ok"]
