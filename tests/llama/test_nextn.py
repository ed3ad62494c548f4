"""Files whose last block is a multi-token-prediction block llama.cpp loads and never runs
(GLM-4.5's ``glm4moe``, DeepSeek-V3's ``deepseek2`` with ``nextn_predict_layers``): capture
records the blocks that run, plan plans them, repack leaves the MTP block in place (or permutes
it when the plan asks), verify checks it byte for byte, and check-dropin passes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moefixtures import grouped_plan, run_cli, tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.synth import synth_model
from moepack.layout.plan import load_plan, save_plan
from moepack.trace import load_trace

pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
pytestmark = pytest.mark.slow

CASES = {
    "glm4moe": dict(arch="glm4moe", layers=4),  # 0 dense, 1-2 MoE, 3 MTP
    "glm4moe-Q4_K_M": dict(arch="glm4moe", layers=3, weight_type="Q4_K_M", hidden=256,
                           expert_ffn=256),  # 0 dense, 1 MoE, 2 MTP
    "deepseek2-nextn": dict(arch="deepseek2", layers=4, nextn_layers=1),
}  # fmt: skip


def _gates(out: str) -> dict[str, dict]:
    doc = json.loads(out)
    assert doc["verdict"] in ("PASS", "FAIL")
    return {g["gate"]: g for g in doc["gates"]}


@pytest.mark.parametrize("case", list(CASES))
def test_capture_plan_repack_verify_and_check_dropin(tmp_path, capsys, case):
    spec = tiny_spec(experts=8, top_k=2, seed=4, **CASES[case])
    model = synth_model(tmp_path / "m.gguf", spec).paths[0]
    with MoeModel(model) as m:
        run, mtp = m.run_block_indices, m.not_run_block_indices
    assert len(mtp) == 1 and mtp[0] == spec.layers - 1 and run
    trace, plan, out = tmp_path / "t.moetrace", tmp_path / "p.moeplan", tmp_path / "r.gguf"
    code, _, err = run_cli(
        capsys, "trace", "capture", model, "-o", trace, "-p", "experts in every block",
        "-p", "a b c d e f g", "-n", "8", "-q",
    )  # fmt: skip
    assert code == 0, err  # was: "llama.cpp routed 0 of N tokens at block <the MTP block>"
    assert load_trace(trace).block_map == run
    code, _, err = run_cli(capsys, "plan", model, "--trace", trace, "--out", plan)
    assert code == 0, err
    assert {lp.block for lp in load_plan(plan).layers} <= set(run)
    code, _, err = run_cli(capsys, "repack", model, "--plan", plan, "--out", out, "-q")
    assert code == 0, err
    code, text, err = run_cli(capsys, "verify", model, out, "--json")
    assert code == 0, err
    assert mtp[0] not in json.loads(text)["blocks_permuted"]  # left in place
    code, text, err = run_cli(capsys, "check-dropin", model, out, "--tokens", "256", "--json", "-q")
    assert code == 0, err
    gates = _gates(text)
    assert all(g["ok"] for g in gates.values()), gates
    assert gates["routing"]["blocks"] == run and gates["routing"]["not_run_blocks"] == mtp
    assert gates["routing"]["cells"] == 256 * len(run)


def test_an_mtp_block_permuted_as_asked_is_verified_and_passes(tmp_path, capsys):
    """A plan that permutes every block, the MTP block too: its bytes are the bytes gate's,
    the blocks llama.cpp runs are judged by the other three."""
    spec = tiny_spec(experts=8, top_k=2, seed=6, **CASES["glm4moe"])
    model = synth_model(tmp_path / "m.gguf", spec).paths[0]
    with MoeModel(model) as m:
        plan = grouped_plan(m, 3)
        assert [lp.block for lp in plan.layers] == [1, 2, 3]
        assert not np.array_equal(plan.layers[-1].perm, np.arange(8))
    out = tmp_path / "r.gguf"
    plan_path = save_plan(plan, tmp_path / "p.moeplan")
    code, _, err = run_cli(
        capsys, "repack", model, "--plan", plan_path, "--out", out, "--keep-header", "-q"
    )
    assert code == 0, err
    code, text, err = run_cli(capsys, "check-dropin", model, out, "--tokens", "256", "--json", "-q")
    assert code == 0, err
    gates = _gates(text)
    assert gates["bytes"]["blocks_permuted"] == [1, 2, 3]
    assert gates["routing"]["permutation"].startswith("found by verify")
    assert gates["routing"]["same_set"] == 1.0 and gates["routing"]["not_run_blocks"] == [3]
