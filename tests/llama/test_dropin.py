"""``check-dropin``: an honest repack passes all four gates; a broken one fails the right one."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from moefixtures import craft_metadata, metadata_entries, run_cli, tiny_spec
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


def _entry(key: str, value: int | bool) -> bytes:
    """One GGUF metadata entry: key, then a UINT32 (type 4) or a BOOL (type 7)."""
    raw = key.encode()
    typed = (
        struct.pack("<I?", 7, value) if isinstance(value, bool) else struct.pack("<II", 4, value)
    )
    return struct.pack("<Q", len(raw)) + raw + typed


def test_the_start_token_is_the_one_llama_cpp_adds(tmp_path, capsys):
    """A BOS id outside the vocabulary in the metadata (a hunyuan-moe file's) and no
    ``add_bos_token`` key: llama.cpp replaces the id with its tokenizer's default, and the
    check of the file against itself passes with the token llama.cpp adds."""
    spec = tiny_spec(layers=2, experts=8, top_k=2, seed=9)
    src = synth_model(tmp_path / "m.gguf", spec).paths[0]
    kvs = [
        raw
        for key, raw in metadata_entries(src)
        if key not in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token")
    ]
    odd = craft_metadata(
        src, tmp_path / "odd.gguf", kvs + [_entry("tokenizer.ggml.bos_token_id", 1_000_000)]
    )
    assert GgufFile(odd).get("tokenizer.ggml.bos_token_id") == 1_000_000
    code, out, err = run_cli(capsys, "check-dropin", odd, odd, "--tokens", "256", "--json", "-q")
    assert code == 0, err  # was: "llama_decode returned -1 on 256 tokens at position 0-255"
    doc = json.loads(out)
    assert doc["verdict"] == "PASS" and doc["start_token"] == 1  # SPM's default <s>
    no_bos = craft_metadata(
        src,
        tmp_path / "nobos.gguf",
        kvs
        + [
            _entry("tokenizer.ggml.bos_token_id", 1_000_000),
            _entry("tokenizer.ggml.add_bos_token", False),
        ],
    )
    code, out, err = run_cli(
        capsys, "check-dropin", no_bos, no_bos, "--tokens", "256", "--json", "-q"
    )
    assert code == 0, err
    assert json.loads(out)["start_token"] is None


def test_a_repack_that_records_no_permutation_maps_back_through_what_verify_found(tmp_path, capsys):
    """``repack --keep-header`` writes no provenance: the bytes gate discovers the
    permutation, and the routing gate maps the candidate's choices back through it."""
    spec = tiny_spec(layers=2, experts=8, top_k=2, seed=9)
    original = synth_model(tmp_path / "m.gguf", spec).paths[0]
    with MoeModel(original) as m:
        rng = np.random.default_rng(4)
        plan = Plan([LayerPlan(b.index, rng.permutation(8)) for b in m.blocks], m.fingerprint)
    out = repack(original, plan, tmp_path / "r.gguf", keep_header=True).outputs[0]
    code, text, err = run_cli(capsys, "check-dropin", original, out, "--json", "-q")
    assert code == 0, err  # was: routing 11 % as sets (the identity assumed)
    gates = _gates(text)
    assert gates["routing"]["permutation"] == "found by verify (the file records none)"
    assert gates["routing"]["same_set"] == 1.0 and gates["routing"]["same_order"] == 1.0
    assert gates["bytes"]["blocks_permuted"] == [0, 1]


def test_a_near_tie_in_router_order_is_not_a_routing_change(tmp_path, capsys):
    """gpt-oss's router bias makes experts 0 and 1 of block 0 tie exactly on every token
    (zero router rows, equal biases far above the others): llama.cpp lists tied experts by
    slot, so a candidate that swaps their slots lists them the other way round, with the same
    weights. The routing gate forgives that order, not a set change."""
    spec = tiny_spec(arch="gpt-oss", layers=2, experts=8, top_k=2, seed=3)
    original = synth_model(tmp_path / "m.gguf", spec).paths[0]
    g = GgufFile(original)
    rows = next(t for t in g.tensors if t.name == "blk.0.ffn_gate_inp.weight")
    bias = next(t for t in g.tensors if t.name == "blk.0.ffn_gate_inp.bias")
    with open(original, "r+b") as fh:
        fh.seek(rows.offset)
        fh.write(np.zeros((2, spec.hidden), "<f4").tobytes())  # rows 0 and 1
        fh.seek(bias.offset)
        fh.write(np.full(2, 50.0, "<f4").tobytes())
    with MoeModel(original) as m:
        swap = np.array([1, 0, 2, 3, 4, 5, 6, 7])
        plan = Plan([LayerPlan(0, swap), LayerPlan(1, np.roll(swap, 3))], m.fingerprint)
    out = repack(original, plan, tmp_path / "r.gguf").outputs[0]
    code, text, err = run_cli(
        capsys, "check-dropin", original, out, "--tokens", "256", "--json", "-q"
    )
    assert code == 0, err  # was: "100.00 % as sets, 50.00 % in order"
    routing = _gates(text)["routing"]
    assert routing["same_set"] == 1.0
    assert routing["same_order"] == 0.5  # block 0 lists 1, 0 where the original lists 0, 1
    assert routing["near_ties"] == 256 and routing["same_order_but_near_ties"] == 1.0
    assert routing["order_tolerance"] > 0  # twice what the F16-KV run moved a weight
    assert "near-ties" in routing["summary"]
