"""store verify on real stores: clean stores pass, a corrupted slice is named, another model's
store is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.synth import synth_model
from moepack.errors import BadInput
from moepack.layout.plan import LayerPlan, Plan, save_plan
from moepack.store import open_store
from moepack.store.build import build_store
from moepack.store.verify import verify_store


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    folder = tmp_path_factory.mktemp("verify")
    model = synth_model(folder / "m.gguf", tiny_spec(layers=2)).paths[0]
    m = MoeModel(model)
    rng = np.random.default_rng(1)
    plan = Plan([LayerPlan(b.index, rng.permutation(b.n_expert)) for b in m.blocks], m.fingerprint)
    save_plan(plan, folder / "p.moeplan")
    store = folder / "s.moestore"
    build_store(model, store, plan=plan)
    return model, store, folder


def corrupt(src, dst, offset: int) -> None:
    data = bytearray(src.read_bytes())
    data[offset] ^= 0x10
    dst.write_bytes(bytes(data))


def test_a_clean_store_verifies(built):
    model, store, _ = built
    r = verify_store(store, model)
    assert r.ok and r.records == 16 and r.parts_verbatim == 48 and r.parts_requantised == 0
    assert r.bytes_compared == open_store(store).payload_bytes and r.checksum_failures == 0


def test_a_corrupted_slice_is_named(tmp_path, built, capsys):
    model, store, _ = built
    with open_store(store) as s:
        rec = s.expert(1, 5)
        part = rec.parts[2]
    bad = tmp_path / "bad.moestore"
    corrupt(store, bad, part.offset + 77)
    r = verify_store(bad, model)
    assert not r.ok and r.differences_total == 1 and r.checksum_failures == 1
    d = r.first
    assert d is not None
    assert (d.block, d.expert, d.slot, d.part) == (1, 5, rec.slot, "down")
    assert d.store_offset == part.offset + 77 and not d.checksum_ok
    assert d.tensor == "blk.1.ffn_down_exps.weight" and "byte 77 of the slice" in d.message
    code, out, err = run_cli(capsys, "store", "verify", bad, model, "--json", "-q")
    assert code == 1
    assert json.loads(out)["differences"][0]["expert"] == 5
    assert "block 1 expert 5" in err and err.count("\n") == 1


def test_a_store_for_another_model_is_bad_input(tmp_path, built, capsys):
    _, store, _ = built
    other = synth_model(tmp_path / "o.gguf", tiny_spec(layers=2, seed=9)).paths[0]
    with pytest.raises(BadInput, match="built from the model with fingerprint"):
        verify_store(store, other)
    code, _, err = run_cli(capsys, "store", "verify", store, other)
    assert code == 2 and "another model" in err


def test_cli_build_with_a_plan_file_then_verify(tmp_path, built, capsys):
    model, _, folder = built
    out = tmp_path / "c.moestore"
    code, _, err = run_cli(
        capsys, "store", "build", model, "--out", out, "--plan", folder / "p.moeplan", "-q"
    )
    assert code == 0, err
    code, stdout, err = run_cli(capsys, "store", "verify", out, model)
    assert code == 0 and "OK" in stdout, err
    code, stdout, _ = run_cli(capsys, "store", "info", out, "--json")
    info = json.loads(stdout)
    assert code == 0 and info["layout"] == "reorder+expert-major"
    assert [b["block"] for b in info["blocks"]] == [0, 1]
