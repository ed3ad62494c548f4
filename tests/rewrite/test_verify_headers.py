"""Headers that lie: verify compares every shard's header entry by entry, in order."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType

from moefixtures import craft_metadata, metadata_entries, tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.gguf_file import GgufFile
from moepack.checkpoint.provenance import pack_kv
from moepack.checkpoint.synth import synth_model
from moepack.layout.plan import LayerPlan, Plan
from moepack.rewrite.repack import repack
from moepack.rewrite.verify import verify


@pytest.fixture
def pair(tmp_path):
    model = synth_model(tmp_path / "m.gguf", tiny_spec()).paths[0]
    m = MoeModel(model)
    rng = np.random.default_rng(1)
    plan = Plan([LayerPlan(b.index, rng.permutation(b.n_expert)) for b in m.blocks], m.fingerprint)
    out = repack(model, plan, tmp_path / "r.gguf").outputs[0]
    assert verify(model, out).ok
    # the crafting helper itself reproduces the file exactly
    same = craft_metadata(out, tmp_path / "same.gguf", [raw for _, raw in metadata_entries(out)])
    assert same.read_bytes() == out.read_bytes()
    return model, out


def _fails(model: Path, bad: Path, needle: str) -> None:
    v = verify(model, bad)
    assert not v.ok, "a lying header verified"
    assert v.difference is not None
    assert needle in v.difference.message, v.difference


def test_extra_provenance_key_alias(pair, tmp_path):
    model, out = pair
    kvs = metadata_entries(out)
    i = next(i for i, (k, _) in enumerate(kvs) if k == "moepack.repack.perm.blk.0")
    alias = pack_kv("moepack.repack.perm.blk.00", GGUFValueType.ARRAY, [7] * 8)
    bad = craft_metadata(
        out,
        tmp_path / "b.gguf",
        [raw for _, raw in kvs[:i]] + [alias] + [raw for _, raw in kvs[i:]],
    )
    _fails(model, bad, "moepack.repack.perm.blk.00")


def test_provenance_with_another_value_type(pair, tmp_path):
    model, out = pair
    kvs = metadata_entries(out)
    raw = [
        r
        if k != "moepack.repack.version"
        else pack_kv(k, GGUFValueType.UINT32, 1)[:-8] + struct.pack("<Ii", 5, 1)
        for k, r in kvs
    ]
    bad = craft_metadata(out, tmp_path / "b.gguf", raw)
    _fails(model, bad, "moepack.repack.version' is not in moepack's canonical form")


@pytest.mark.parametrize("key", ["GGUF.evil", "split.evil", "general.evil"])
def test_extra_keys_of_any_prefix(pair, tmp_path, key):
    model, out = pair
    kvs = [raw for _, raw in metadata_entries(out)]
    bad = craft_metadata(
        out, tmp_path / "b.gguf", kvs[:3] + [pack_kv(key, GGUFValueType.UINT32, 1)] + kvs[3:]
    )
    _fails(model, bad, key)


def test_reordered_metadata(pair, tmp_path):
    model, out = pair
    kvs = [raw for _, raw in metadata_entries(out)]
    kvs[1], kvs[2] = kvs[2], kvs[1]
    _fails(model, craft_metadata(out, tmp_path / "b.gguf", kvs), "reordered")


def test_trailing_zero_bytes(pair, tmp_path):
    model, out = pair
    g = GgufFile(out)
    raw = out.read_bytes()
    assert len(raw) % g.alignment == 0
    bad = tmp_path / "b.gguf"
    bad.write_bytes(raw + bytes(g.alignment // 2))
    _fails(model, bad, "after the last tensor")


def test_split_shard_tampering(tmp_path):
    res = synth_model(
        tmp_path / "s.gguf", tiny_spec(layers=4, weight_type="Q8_0"), split_max_size=40_000
    )
    m = MoeModel(res.paths[0])
    rng = np.random.default_rng(2)
    plan = Plan([LayerPlan(b.index, rng.permutation(b.n_expert)) for b in m.blocks], m.fingerprint)
    outs = repack(res.paths[0], plan, tmp_path / "o.gguf").outputs
    assert verify(res.paths[0], outs[0]).ok
    second = outs[1]
    saved = second.read_bytes()
    # metadata added to a later shard
    kvs = [raw for _, raw in metadata_entries(second)]
    craft_metadata(second, second, kvs + [pack_kv("general.name", GGUFValueType.STRING, "EVIL")])
    v = verify(res.paths[0], outs[0])
    assert v.difference is not None
    assert not v.ok and "general.name" in v.difference.message and v.difference.file == str(second)
    # a later shard whose provenance lies
    second.write_bytes(saved)
    kvs = []
    for k, raw in metadata_entries(second):
        if k == "moepack.repack.original_fingerprint":
            raw = pack_kv(k, GGUFValueType.STRING, "0" * 32)
        kvs.append(raw)
    craft_metadata(second, second, kvs)
    v = verify(res.paths[0], outs[0])
    assert v.difference is not None
    assert not v.ok and v.difference.what == "provenance"
