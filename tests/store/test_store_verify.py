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


def rewrite_index(src, dst, edit) -> None:
    """``src`` with its index edited by ``edit`` (on the parsed JSON) and the header's
    length and sha256 recomputed, as a forger would."""
    import hashlib

    from moepack.store.format import HEADER, Header, unpack_header

    data = bytearray(src.read_bytes())
    h = unpack_header(bytes(data[: HEADER.size]))
    assert isinstance(h, Header)
    doc = json.loads(bytes(data[h.index_offset : h.index_offset + h.index_length]))
    edit(doc)
    raw = json.dumps(doc).encode()
    new = Header(h.alignment, h.data_offset, h.data_end, h.index_offset, len(raw),
                 hashlib.sha256(raw).digest())  # fmt: skip
    data[: HEADER.size] = new.pack()
    dst.write_bytes(bytes(data[: h.index_offset]) + raw)


def _swap_labels(doc, names: bool) -> None:
    """Block 0 and 1 swap labels, and gate and up swap kinds (``names``: the tensor names
    too, so the index is consistent with itself and only the model's bytes can tell)."""
    b0, b1 = doc["blocks"][0], doc["blocks"][1]
    b0["block"], b1["block"] = b1["block"], b0["block"]
    for b in (b0, b1):
        for part in b["parts"]:
            swap = {"gate": "up", "up": "gate"}
            part["kind"] = swap.get(part["kind"], part["kind"])
            if names:
                block, _, rest = part["tensor"].removeprefix("blk.").partition(".")
                if part["kind"] in ("gate", "up"):
                    rest = rest.replace("gate", "@").replace("up", "gate").replace("@", "up")
                part["tensor"] = f"blk.{b['block']}.{rest}"


def test_an_index_that_swaps_block_and_kind_labels_is_refused(tmp_path, built, capsys):
    """Labels swapped, sha256 recomputed: verify said OK and replay served block 0 from
    block 1's records. The reader now checks each part's labels against its tensor."""
    from moepack.trace import save_trace, synth_trace

    model, store, _ = built
    liar = tmp_path / "liar.moestore"
    rewrite_index(store, liar, lambda d: _swap_labels(d, names=False))
    code, _, err = run_cli(capsys, "store", "verify", liar, model)
    assert code == 2 and err.count("\n") == 1, err
    assert "store index: block 1 parts[0] is tensor 'blk.0." in err and "not of block 1" in err
    with MoeModel(model) as m:
        trace = tmp_path / "t.moetrace"
        save_trace(synth_trace(m, tokens=50, seed=1), trace)
    code, _, err = run_cli(capsys, "replay", liar, trace, "--slots", 4)
    assert code == 2 and "not of block 1" in err, err


def test_an_index_consistent_with_itself_is_checked_against_the_models_bytes(
    tmp_path, built, capsys
):
    model, store, _ = built
    liar = tmp_path / "liar.moestore"
    rewrite_index(store, liar, lambda d: _swap_labels(d, names=True))
    with open_store(liar) as s:  # it reads as a store: nothing in it contradicts itself
        assert s.blocks == [0, 1]
    r = verify_store(liar, model)
    assert not r.ok and r.checksum_failures == 0
    assert r.differences_total == 16 * 3  # every record: its gate, up and down are another's
    assert {(d.block, d.part) for d in r.differences} == {
        (b, k) for b in (0, 1) for k in ("gate", "up", "down")
    }
    code, _, err = run_cli(capsys, "store", "verify", liar, model, "-q")
    assert code == 1 and "differs from blk." in err and err.count("\n") == 1
