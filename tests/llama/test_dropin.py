"""``check-dropin``: an honest repack passes all four gates; a broken one fails the right one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.gguf_file import GgufFile
from moepack.checkpoint.synth import synth_model
from moepack.layout.plan import LayerPlan, Plan
from moepack.rewrite.repack import repack

pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("dropin")
    original = synth_model(d / "m.gguf", tiny_spec(layers=2, experts=8, top_k=2, seed=9)).paths[0]
    m = MoeModel(original)
    rng = np.random.default_rng(4)
    plan = Plan([LayerPlan(b.index, rng.permutation(b.n_expert)) for b in m.blocks], m.fingerprint)
    return original, repack(original, plan, d / "r.gguf").outputs[0]


def _gates(stdout: str) -> dict[str, dict]:
    return {g["gate"]: g for g in json.loads(stdout)["gates"]}


def test_an_honest_repack_passes_every_gate(pair, capsys):
    original, candidate = pair
    code, out, err = run_cli(capsys, "check-dropin", original, candidate, "--json", "-q")
    assert code == 0, err
    gates = _gates(out)
    assert all(g["ok"] for g in gates.values())
    assert gates["routing"]["same_order"] == 1.0 and gates["routing"]["cells"] == 1024 * 2
    assert gates["output"]["tokens"] >= 1000
    assert gates["output"]["kl"] <= gates["output"]["envelope_kl"]
    assert gates["control"]["bit_identical"] is True
    assert json.loads(out)["verdict"] == "PASS"


def test_a_router_left_unpermuted_fails_the_routing_gate(pair, tmp_path, capsys):
    """The experts moved but block 0's router rows did not: the recorded permutation no
    longer maps the candidate's choices back, and the outputs drift."""
    original, candidate = pair
    broken = shutil.copy(candidate, tmp_path / "broken.gguf")
    name = "blk.0.ffn_gate_inp.weight"
    src = next(t for t in GgufFile(original).tensors if t.name == name)
    dst = next(t for t in GgufFile(broken).tensors if t.name == name)
    raw = Path(original).read_bytes()[src.offset : src.end]
    with open(broken, "r+b") as fh:
        fh.seek(dst.offset)
        fh.write(raw)
    code, out, err = run_cli(capsys, "check-dropin", original, broken, "--json", "-q")
    assert code == 1
    assert "routing" in err and err.count("\n") == 1
    gates = _gates(out)
    assert gates["control"]["ok"] is True
    assert gates["routing"]["ok"] is False and gates["routing"]["same_set"] < 1.0
    assert gates["bytes"]["ok"] is False
    assert gates["output"]["kl"] > gates["output"]["envelope_kl"]
    assert json.loads(out)["verdict"] == "FAIL"


def test_a_dense_candidate_is_bad_input(pair, tmp_path, capsys):
    original, _ = pair
    code, _, err = run_cli(capsys, "check-dropin", original, tmp_path / "none.gguf")
    assert code == 2 and err.startswith("moepack: error:")
