"""Binding roles to a .q4nx file's own tensor names: inspect proposes, pack --names packs
byte-identically to the canonical spelling, and bad names files are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moepack.npu.geometry import Geometry
from moepack.npu.profiles import get_profile
from moepack.npu.q4nx import TensorSpec, write_q4nx
from moepack.npu.synth import produce

from .conftest import TINY_LAYER, TINY_PROFILE

HF = {
    "up_exps": "model.layers.{L}.mlp.experts.up_proj.weight",
    "gate_exps": "model.layers.{L}.mlp.experts.gate_proj.weight",
    "down_exps": "model.layers.{L}.mlp.experts.down_proj.weight",
    "shared_expert_gate": "model.layers.{L}.mlp.shared_expert_gate.weight",
    "moe_router": "model.layers.{L}.mlp.gate.weight",
}
FLM = {
    "up_exps": "blk.{L}.ffn_up_exps",
    "gate_exps": "blk.{L}.ffn_gate_exps",
    "down_exps": "blk.{L}.ffn_down_exps",
    "shared_expert_gate": "blk.{L}.ffn_gate_inp_shexp",
    "moe_router": "blk.{L}.ffn_gate_inp",
}


def renamed_model(path: Path, spelling: dict[str, str], seed: int = 1) -> Path:
    """The tiny fixture model's tensors, same bytes, under another spelling."""
    geo = Geometry.scaled(1)
    roles = get_profile(TINY_PROFILE).layout(geo, geo.kind(TINY_LAYER)).roles()
    canon = {}
    specs = []
    for r in roles:
        shape = geo.shape(r)
        spec = TensorSpec(spelling[r].format(L=TINY_LAYER), shape.dtype, shape.shape)
        canon[spec.name] = TensorSpec(geo.name_of(r, TINY_LAYER), shape.dtype, shape.shape)
        specs.append(spec)
    with open(path, "wb") as fh:
        write_q4nx(
            fh, specs, lambda s: produce(canon[s.name], seed), {"moepack.geometry": geo.name}
        )
    return path


def buffers(pack: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(pack.glob("layer-*.bin"))}


@pytest.mark.parametrize("spelling", [HF, FLM], ids=["hf", "flm"])
def test_renamed_model_packs_byte_identically_once_bound(spelling, tiny_pack, tmp_path, cli):
    model = renamed_model(tmp_path / "renamed.q4nx", spelling)
    names = tmp_path / "names.json"
    r = cli("npu", "inspect", model, "--profile", TINY_PROFILE, "--write-names", names, "--json")
    assert r.code == 0, r.err
    res = json.loads(r.out)
    assert res["geometry"] == "scaled-1" and len(res["tensors"]) == 5
    # up and gate experts share dtype and shape: only the user can tell them apart
    assert res["ambiguous"] == {
        "gate_exps": sorted([spelling["up_exps"], spelling["gate_exps"]]),
        "up_exps": sorted([spelling["up_exps"], spelling["gate_exps"]]),
    }
    assert res["roles"] == {
        k: spelling[k] for k in ("down_exps", "moe_router", "shared_expert_gate")
    }
    assert res["missing"] == {}
    by_name = {t["name"]: t for t in res["tensors"]}
    down = by_name[spelling["down_exps"].format(L=TINY_LAYER)]
    assert (down["role"], down["how"], down["dtype"]) == ("down_exps", "shape", "I8")
    assert by_name[spelling["up_exps"].format(L=TINY_LAYER)]["how"] == "ambiguous"

    out = tmp_path / "pack"
    r = cli("npu", "pack", model, "--out", out, "--profile", TINY_PROFILE, "--names", names, "-q")
    assert r.code == 2 and "roles left unresolved: gate_exps, up_exps" in r.one_line_error()
    assert not out.exists()
    r = cli("npu", "pack", model, "--out", out, "--profile", TINY_PROFILE, "-q")
    assert r.code == 2 and "npu inspect --write-names" in r.one_line_error() and not out.exists()

    doc = json.loads(names.read_text())
    doc["roles"] |= {"up_exps": spelling["up_exps"], "gate_exps": spelling["gate_exps"]}
    doc["unresolved"] = {}
    names.write_text(json.dumps(doc))
    r = cli("npu", "pack", model, "--out", out, "--profile", TINY_PROFILE, "--names", names, "-q")
    assert r.code == 0, r.err
    assert buffers(out) == buffers(tiny_pack) and buffers(out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["tensor_binding"] == {"source": str(names), "roles": doc["roles"]}
    # unpack --check reads the renamed model through the manifest's binding
    back = tmp_path / "back.q4nx"
    r = cli("npu", "unpack", out, "--out", back, "--check", model, "-q")
    assert r.code == 0, r.err
    manifest["model"]["tensor_binding"]["roles"]["up_exps"] = 5
    (out / "manifest.json").write_text(json.dumps(manifest))
    r = cli("npu", "unpack", out, "--out", tmp_path / "back2.q4nx", "--check", model, "-q")
    assert r.code == 2 and "model.tensor_binding.roles.up_exps is 5" in r.one_line_error()

    # bound the wrong way round, the bytes differ: the binding is what decides
    doc["roles"] |= {"up_exps": spelling["gate_exps"], "gate_exps": spelling["up_exps"]}
    names.write_text(json.dumps(doc))
    swapped = tmp_path / "swapped"
    r = cli("npu", "pack", model, "--out", swapped, "--profile", TINY_PROFILE, "--names", names)
    assert r.code == 0 and buffers(swapped) != buffers(tiny_pack)


def test_missing_roles_and_a_role_bound_beside_its_canonical_name(tiny_model, tmp_path, cli):
    spelling = dict(FLM)
    del spelling["moe_router"]
    model = tmp_path / "m.q4nx"
    geo = Geometry.scaled(1)
    specs = [
        TensorSpec(t.format(L=TINY_LAYER), geo.shape(r).dtype, geo.shape(r).shape)
        for r, t in spelling.items()
    ]
    with open(model, "wb") as fh:
        write_q4nx(fh, specs, lambda s: produce(s, 1), {"moepack.geometry": geo.name})
    r = cli("npu", "inspect", model, "--profile", TINY_PROFILE, "--json")
    assert r.code == 0 and json.loads(r.out)["missing"] == {"moe_router": [TINY_LAYER]}
    names = tmp_path / "names.json"
    names.write_text(
        json.dumps({"format": "moepack.npu.names", "version": 1, "roles": {"up_exps": "{L}"}})
    )
    r = cli("npu", "pack", tiny_model, "--out", tmp_path / "p", "--names", names)
    assert r.code == 2 and "names no tensor in the file" in r.one_line_error()
    names.write_text(
        json.dumps(
            {
                "format": "moepack.npu.names",
                "version": 1,
                "roles": {"up_exps": "model.layer.{L}.mlp.gate_exps_proj.weight"},
            }
        )
    )
    r = cli("npu", "pack", tiny_model, "--out", tmp_path / "p", "--names", names)
    line = r.one_line_error()
    assert r.code == 2 and "role up_exps of layer 3 is both 'model.layer.3.mlp.up_exps" in line


def test_canonical_model_needs_no_binding(tiny_model, cli):
    r = cli("npu", "inspect", tiny_model, "--profile", TINY_PROFILE, "--json")
    res = json.loads(r.out)
    assert r.code == 0 and res["roles"] == {} and res["ambiguous"] == {} and res["missing"] == {}
    assert {t["how"] for t in res["tensors"]} == {"name"}
    assert res["notes"] == ["every role has moepack's own name: no binding needed"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("[1, 2]", "names file: is a JSON list, expected an object"),
        ("{not json", "names file: is not JSON"),
        (
            '{"format": "moepack.npu.names", "version": 1, "roles": ["up_exps"]}',
            "'roles' is not an object",
        ),
        (
            '{"format": "moepack.npu.names", "version": 1, "roles": {"up_exps": 7}}',
            "roles.up_exps is 7, expected a string",
        ),
        (
            '{"format": "moepack.npu.names", "version": 1, "roles": {"up": "x.{L}"}}',
            "unknown role 'up'",
        ),
        (
            '{"format": "moepack.npu.names", "version": 1, "roles": {"up_exps": "blk.3.up"}}',
            "needs exactly one '{L}'",
        ),
        (
            '{"format": "moepack.npu.names", "version": 1, "roles": '
            '{"up_exps": "blk.{L}.ffn_up_exps", "up_exps": "blk.{L}.ffn_gate_exps"}}',
            "role 'up_exps' is bound twice",
        ),
        (
            '{"format": "moepack.npu.names", "version": 1, "roles": '
            '{"up_exps": "blk.{L}.ffn_up_exps", "gate_exps": "blk.{L}.ffn_up_exps"}}',
            "roles 'up_exps' and 'gate_exps' are bound to one tensor",
        ),
        (
            '{"format": "moepack.npu.names", "version": 1, "roles": {"up_exps": "blk.{L}.nope"}}',
            "roles.up_exps 'blk.{L}.nope' names no tensor in the file",
        ),
        ('{"format": "other", "version": 1, "roles": {}}', "format/version is not"),
    ],
)
def test_bad_names_files_are_one_line_errors(text, message, tmp_path, cli):
    model = renamed_model(tmp_path / "m.q4nx", FLM)
    before = model.read_bytes()
    names = tmp_path / "names.json"
    names.write_text(text)
    out = tmp_path / "pack"
    r = cli("npu", "pack", model, "--out", out, "--profile", TINY_PROFILE, "--names", names)
    assert r.code == 2 and message in r.one_line_error()
    assert not out.exists() and model.read_bytes() == before


def _names_path(kind: str, tmp_path: Path) -> Path:
    """A names file that is hostile as a path or as bytes."""
    import os

    p = tmp_path / "names.json"
    if kind == "deep":
        p.write_text('{"format": "moepack.npu.names", "roles": ' + "[" * 3000 + "]" * 3000 + "}")
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "dev-zero":
        p.symlink_to("/dev/zero")
    elif kind == "huge":
        p.write_bytes(b" " * (2 << 20))
    elif kind == "big-int":
        p.write_text('{"format": "moepack.npu.names", "version": ' + "9" * 5000 + "}")
    return p


@pytest.mark.parametrize(
    "kind, message",
    [
        ("deep", "names file: is nested too deeply (3,001 levels; at most 64"),
        ("fifo", "is a FIFO (named pipe), not a names file"),
        ("dev-zero", "is a character device, not a names file"),
        ("huge", "2,097,152 bytes is more than a names file may hold (1,048,576 bytes)"),
        ("big-int", "names file: is not JSON: integer 999999999999999999999999"),
    ],
)
def test_names_files_are_read_like_every_input(kind, message, tmp_path, cli):
    """Deep nesting was a RecursionError, a FIFO blocked the pack, /dev/zero filled memory."""
    model = renamed_model(tmp_path / "m.q4nx", FLM)
    names = _names_path(kind, tmp_path)
    out = tmp_path / "pack"
    r = cli("npu", "pack", model, "--out", out, "--profile", TINY_PROFILE, "--names", names)
    assert r.code == 2 and message in r.one_line_error()
    assert not out.exists()
