"""store build and open_store on real files: every record's bytes, order, alignment, checksums."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
from gguf import GGUFReader

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.synth import synth_model
from moepack.errors import BadInput
from moepack.layout.layout import LayoutOptions, place
from moepack.layout.plan import LayerPlan, Plan
from moepack.store import open_store
from moepack.store.build import build_store
from moepack.store.format import HEADER
from moepack.store.verify import verify_store


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("store-model")
    return synth_model(folder / "m.gguf", tiny_spec(layers=3)).paths[0]


def source_slices(path) -> dict[str, np.ndarray]:
    """Each expert tensor's data as gguf-py reads it (numpy's outermost axis = experts)."""
    return {t.name: np.asarray(t.data) for t in GGUFReader(path).tensors if "_exps" in t.name}


def random_plan(path, seed: int) -> Plan:
    m = MoeModel(path)
    rng = np.random.default_rng(seed)
    layers = [LayerPlan(b.index, rng.permutation(b.n_expert)) for b in m.blocks]
    return Plan(layers, m.fingerprint, str(path), source="test")


def test_every_record_holds_its_experts_source_bytes(tmp_path, model):
    res = build_store(model, tmp_path / "s.moestore")
    slices = source_slices(model)
    with open_store(tmp_path / "s.moestore") as store, MoeModel(model) as m:
        assert store.fingerprint == m.fingerprint == res.fingerprint
        assert store.blocks == [0, 1, 2] and store.n_expert == 8 and store.alignment == 4096
        assert store.data_path == tmp_path / "s.moestore"
        for b in store.blocks:
            sources = store.block_index(b).sources
            assert [s.kind for s in sources] == ["gate", "up", "down"]
            for rec in store.experts(b):
                assert rec.offset % 4096 == 0 and rec.size % 4096 == 0
                data = store.read_record(rec)
                assert (
                    hashlib.sha256(
                        b"".join(
                            data[p.offset - rec.offset : p.offset - rec.offset + p.size]
                            for p in rec.parts
                        )
                    ).hexdigest()
                    == rec.checksum
                )
                for part, src in zip(rec.parts, sources, strict=True):
                    want = slices[src.tensor][rec.expert].tobytes()
                    got = data[part.offset - rec.offset : part.offset - rec.offset + part.size]
                    assert got == want, (b, rec.expert, part.kind)
                    assert part.shape == tuple(m.tensors[src.tensor].ne[:-1])
        assert res.payload_bytes == res.source_expert_bytes == store.payload_bytes
        assert res.store_bytes == os.path.getsize(tmp_path / "s.moestore")


def test_records_follow_the_plan_and_the_expert_major_layout(tmp_path, model):
    plan = random_plan(model, seed=5)
    build_store(model, tmp_path / "s.moestore", plan=plan)
    with open_store(tmp_path / "s.moestore") as store, MoeModel(model) as m:
        placement = place(m, "reorder+expert-major", LayoutOptions(plan, 4096))
        previous_end = 0
        for b in store.blocks:
            recs = store.experts(b)
            perm = plan.perm_for(b)
            assert perm is not None
            assert [r.expert for r in recs] == perm.tolist()  # slot s holds expert perm[s]
            bp = placement.block(b)
            start = bp.region[0]
            base = recs[0].offset
            for rec in recs:
                assert store.expert(b, rec.expert) == rec
                for part, placed in zip(rec.parts, bp.tensors, strict=True):
                    assert part.offset - base == int(placed.offsets[rec.expert]) - start
                assert rec.offset >= previous_end  # storage order is file order
                previous_end = rec.offset + rec.size


def test_split_and_fused_models_become_stores(tmp_path):
    split = synth_model(tmp_path / "sp.gguf", tiny_spec(layers=3), split_max_size=200_000)
    assert len(split.paths) > 1
    build_store(split.paths[0], tmp_path / "sp.moestore")
    fused_spec = tiny_spec(arch="deepseek2", fused_gate_up=True, shared_experts=1, dense_layers=0)
    fused = synth_model(tmp_path / "fu.gguf", fused_spec).paths[0]
    build_store(fused, tmp_path / "fu.moestore")
    with open_store(tmp_path / "sp.moestore") as s:
        assert s.blocks == [0, 1, 2]
        with MoeModel(split.paths[0]) as m:
            assert s.fingerprint == m.fingerprint
            assert any(len({t.shard for t in b.weight_tensors}) > 1 for b in m.blocks)
    assert verify_store(tmp_path / "sp.moestore", split.paths[-1]).ok  # any shard names it
    with open_store(tmp_path / "fu.moestore") as s:
        assert [p.kind for p in s.expert(0, 3).parts] == ["gate_up", "down"]
        slices = source_slices(fused)
        rec = s.expert(1, 6)
        gu = rec.parts[0]
        assert s.read_record(rec)[: gu.size] == slices["blk.1.ffn_gate_up_exps.weight"][6].tobytes()


def test_open_store_refuses_what_is_not_a_sound_store(tmp_path, model):
    good = tmp_path / "s.moestore"
    build_store(model, good)
    raw = good.read_bytes()
    cases = {
        "gguf.moestore": model.read_bytes(),
        "short.moestore": raw[:20],
        "truncated.moestore": raw[:-10],
    }
    # one flipped byte inside the index
    flipped = bytearray(raw)
    flipped[-5] ^= 0x40
    cases["index.moestore"] = bytes(flipped)
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    messages = {}
    for name in cases:
        with pytest.raises(BadInput) as e:
            open_store(tmp_path / name)
        messages[name] = str(e.value)
        assert str(e.value).startswith(str(tmp_path / name)) and "\n" not in str(e.value)
    assert "not a moepack expert store" in messages["gguf.moestore"]
    assert "truncated" in messages["truncated.moestore"]
    assert "corrupt" in messages["index.moestore"]
    with pytest.raises(BadInput, match="no such expert store"):
        open_store(tmp_path / "missing.moestore")


def test_an_index_that_lies_about_offsets_is_refused(tmp_path, model):
    good = tmp_path / "s.moestore"
    build_store(model, good)
    raw = bytearray(good.read_bytes())
    fields = HEADER.unpack_from(raw)
    i0, ilen = fields[6], fields[7]
    doc = json.loads(raw[i0 : i0 + ilen])
    doc["blocks"][0]["experts"][1]["offset"] = doc["blocks"][0]["experts"][0]["offset"]
    new = json.dumps(doc).encode()
    header = HEADER.pack(*fields[:7], len(new), hashlib.sha256(new).digest())
    bad = tmp_path / "lies.moestore"
    bad.write_bytes(header + bytes(raw[HEADER.size : i0]) + new)
    with pytest.raises(BadInput, match="store index: block 0 experts"):
        open_store(bad)


def test_cli_store_build(tmp_path, model, capsys):
    out = tmp_path / "c.moestore"
    code, stdout, err = run_cli(capsys, "store", "build", model, "--out", out, "--json", "-q")
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["experts"] == 24 and doc["out"] == str(out) and out.exists()
    code, _, err = run_cli(capsys, "store", "build", model, "--out", tmp_path / "x.gguf", "-q")
    assert code == 2 and "extension '.gguf'" in err and not (tmp_path / "x.gguf").exists()


def test_per_expert_biases_travel_with_their_expert(tmp_path):
    """gpt-oss carries a bias per expert matrix: each is a part of its expert's record."""
    model = synth_model(tmp_path / "g.gguf", tiny_spec(arch="gpt-oss")).paths[0]
    build_store(model, tmp_path / "g.moestore")
    slices = {t.name: np.asarray(t.data) for t in GGUFReader(model).tensors}
    with open_store(tmp_path / "g.moestore") as s:
        rec = s.expert(1, 3)
        kinds = [p.kind for p in rec.parts]
        assert kinds == ["gate", "gate_bias", "up", "up_bias", "down", "down_bias"]
        data = s.read_record(rec)
        bias = rec.parts[5]
        lo = bias.offset - rec.offset
        want = slices["blk.1.ffn_down_exps.bias"][3].tobytes()
        assert data[lo : lo + bias.size] == want


def test_the_free_space_estimate_is_the_stores_size(tmp_path, model):
    """The estimate was 20,975,616 B for a store of 12,592,495 B (a fixed 8 MiB for the
    index), refusing builds that fit a nearly full disk. Without a precision plan it is exact."""
    with MoeModel(model) as m:
        rng = np.random.default_rng(3)
        plan = Plan([LayerPlan(b.index, rng.permutation(b.n_expert)) for b in m.blocks],
                    m.fingerprint)  # fmt: skip
    for i, p in enumerate([None, plan]):
        out = tmp_path / f"s{i}.moestore"
        r = build_store(model, out, plan=p)
        assert r.estimated_bytes == r.store_bytes == out.stat().st_size
