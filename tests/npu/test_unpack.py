"""``unpack`` on damaged manifests, disagreeing copies, and ``--check`` against the right and
the wrong model: one-line errors, and nothing left behind that failed its check."""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest

from moepack.errors import BadInput, MoepackError, VerificationFailed
from moepack.npu.geometry import Geometry
from moepack.npu.profiles import get_profile
from moepack.npu.q4nx import Q4nxFile
from moepack.npu.unpack import unpack

from .conftest import LINEAR, TINY_LAYER, TINY_PROFILE, write_layer_model


def _copy(pack, tmp_path, edit=None):
    dst = tmp_path / "pack"
    shutil.copytree(pack, dst)
    if edit is not None:
        doc = json.loads((dst / "manifest.json").read_text())
        edit(doc)
        (dst / "manifest.json").write_text(json.dumps(doc))
    return dst


def _set(path, value):
    def edit(doc):
        obj = doc
        for k in path[:-1]:
            obj = obj[k]
        obj[path[-1]] = value

    return edit


def _pop(path):
    def edit(doc):
        obj = doc
        for k in path[:-1]:
            obj = obj[k]
        obj.pop(path[-1])

    return edit


def _relayer(n):
    def edit(doc):
        doc["layers"][0]["layer"] = n
        for b in doc["layers"][0]["buffers"]:
            b["file"] = f"layer-{n:02d}.{b['name']}.bin"

    return edit


L0, T0, B0 = ["layers", 0], ["layers", 0, "tensors", 0], ["layers", 0, "buffers", 0]
DAMAGE = {
    "kind missing": (_pop(L0 + ["kind"]), "layers[0].kind is missing"),
    "kind wrong": (_set(L0 + ["kind"], "linear"), "is listed as 'linear', geometry scaled-1 says"),
    "dtype Q9": (_set(T0 + ["dtype"], "Q9"), "tensors[0].dtype is 'Q9', expected a .q4nx dtype"),
    "nbytes str": (_set(T0 + ["nbytes"], "x"), "tensors[0].nbytes is 'x', expected an integer"),
    "shape str": (_set(T0 + ["shape"], "ab"), "tensors[0].shape is 'ab', expected a list"),
    "shape negative": (_set(T0 + ["shape"], [-1, 4]), "tensors[0].shape[0] is -1, expected an"),
    "shape other": (_set(T0 + ["shape"], [4, 4]), "tensors[0].nbytes is"),
    "tensors empty": (_set(L0 + ["tensors"], []), "the manifest lists none"),
    "tensor dropped": (lambda d: d["layers"][0]["tensors"].pop(), "places the tensor roles"),
    "retained str": (_set(T0 + ["retained"], "x"), "tensors[0].retained is 'x'"),
    "retained wrong": (_set(T0 + ["retained"], 5), "retains 5 bytes, profile seed-2026-09 keeps"),
    "role unknown": (_set(T0 + ["role"], "nope"), "tensors[0].role is 'nope'"),
    "name other": (_set(T0 + ["name"], "model.layer.3.x"), "tensor 'model.layer.3.x'"),
    "file absolute": (_set(B0 + ["file"], "/etc/passwd"), "file is '/etc/passwd', expected 'lay"),
    "file parent": (_set(B0 + ["file"], "../manifest.json"), "file is '../manifest.json'"),
    "size other": (_set(B0 + ["size"], 5), "size 5, profile seed-2026-09 says"),
    "sha not hex": (_set(B0 + ["sha256"], "zz"), "sha256 is 'zz', expected 64 hex digits"),
    "buffer dropped": (lambda d: d["layers"][0]["buffers"].pop(), "has the buffers weights, rou"),
    "layers str": (_set(["layers"], "x"), "field layers is 'x', expected a list"),
    "layers empty": (_set(["layers"], []), "field layers is empty"),
    "layer negative": (_set(L0 + ["layer"], -1), "layers[0].layer is -1, expected an integer"),
    "layer 99": (_set(L0 + ["layer"], 99), "file is 'layer-03.weights.bin', expected 'layer-99."),
    "layer 45": (_relayer(45), "manifest layer 45: geometry scaled-1 has 40 layers"),
    "layer bool": (_set(L0 + ["layer"], True), "layers[0].layer is True"),
    "layer twice": (lambda d: d["layers"].append(copy.deepcopy(d["layers"][0])), "repeats layer"),
    "geometry huge": (_set(["model", "geometry"], "scaled-200000000"), "unknown geometry"),
    "geometry other": (_set(["model", "geometry"], "scaled-7"), "is not 'model.layer.3.mlp"),
    "profile unknown": (_set(["profile", "name"], "zzz"), "unknown profile 'zzz'"),
    "profile other": (_set(["profile", "name"], "flm-0.9.46"), "profile flm-0.9.46 places"),
    "model missing": (_pop(["model"]), "manifest field model is missing"),
    "version": (_set(["version"], 99), "manifest version 99; this moepack reads 1"),
}  # fmt: skip


@pytest.mark.parametrize("label", list(DAMAGE))
def test_damaged_manifest_is_one_named_error(tiny_pack, tmp_path, label):
    edit, message = DAMAGE[label]
    pack = _copy(tiny_pack, tmp_path, edit)
    out = tmp_path / "back.q4nx"
    with pytest.raises(BadInput) as e:
        unpack(pack, out)
    assert message in str(e.value), str(e.value)
    assert not out.exists() and {p.name for p in tmp_path.iterdir()} == {"pack"}


def test_damaged_manifest_on_the_command_line(cli, tiny_pack, tmp_path):
    pack = _copy(tiny_pack, tmp_path, _set(B0 + ["file"], "/etc/passwd"))
    r = cli("npu", "unpack", pack, "--out", tmp_path / "back.q4nx")
    assert r.code == 2 and "expected 'layer-03.weights.bin'" in r.one_line_error()
    (pack / "layer-03.weights.bin").unlink()
    (pack / "layer-03.weights.bin").symlink_to("/etc/passwd")
    (pack / "manifest.json").write_text((tiny_pack / "manifest.json").read_text())
    r = cli("npu", "unpack", pack, "--out", tmp_path / "back.q4nx")
    assert r.code == 2 and "resolves outside the pack folder" in r.one_line_error()


def test_check_that_finds_differences_keeps_nothing(cli, tiny_model, tiny_pack, tmp_path):
    """Same header (same tensors and metadata), other bytes: the fingerprint matches, the
    comparison does not, and the unpacked file is not left behind."""
    geo = Geometry.scaled(1)
    roles = get_profile(TINY_PROFILE).layout(geo, geo.kind(TINY_LAYER)).roles()
    other = write_layer_model(tmp_path / "other.q4nx", geo, TINY_LAYER, roles, seed=2)
    out = tmp_path / "back.q4nx"
    res = unpack(tiny_pack, out, check_model=other)
    assert not res.written and not out.exists() and res.differing > 0
    up = geo.name_of("up_exps", TINY_LAYER)
    assert 0 < res.check_mismatches[up] <= next(t.retained for t in res.tensors if t.name == up)
    r = cli("npu", "unpack", tiny_pack, "--out", out, "--check", other)
    line = r.one_line_error()
    assert r.code == 1 and "retained bytes differ from" in line and "nothing was written" in line
    assert "nothing written to" in r.out and not out.exists()
    assert [p.name for p in tmp_path.iterdir() if "moepack-tmp" in p.name] == []
    res = unpack(tiny_pack, out, check_model=tiny_model)
    assert res.written and out.exists() and res.differing == 0 and not res.other_model


def test_check_against_another_model_is_refused_up_front(cli, tiny_model, tiny_pack, tmp_path):
    with Q4nxFile(tiny_model) as m:
        specs = [(n, e) for n, e in m.entries.items()]
        data = {n: bytes(m.raw(n)) for n, _ in specs}
    from moepack.npu.q4nx import TensorSpec, write_q4nx

    renamed = tmp_path / "renamed.q4nx"  # same tensor bytes, one more metadata entry
    with open(renamed, "wb") as fh:
        write_q4nx(fh, [TensorSpec(n, e.dtype, e.shape) for n, e in specs],
                   lambda s: [data[s.name]], {"moepack.geometry": "scaled-1", "x": "y"})  # fmt: skip
    out = tmp_path / "back.q4nx"
    r = cli("npu", "unpack", tiny_pack, "--out", out, "--check", renamed)
    line = r.one_line_error()
    assert r.code == 2 and "not the model this pack was made from" in line
    assert "header's sha256 differs" in line and not out.exists()
    r = cli("npu", "unpack", tiny_pack, "--out", out, "--check", renamed, "--allow-other-model")
    assert r.code == 0, r.err
    assert "is not the pack's model" in r.out and "all retained bytes match" in r.out


def test_disagreeing_copies_of_a_source_byte_are_refused(packed, tmp_path):
    """The seed's gate_proj k-order holds some tiles twice: (239, 232) repeats tile 232 of
    the first pair (232, 225). Change one copy and unpack must say so, not pick one."""
    pack = _copy(packed("seed-2026-09"), tmp_path)
    geo = Geometry.scaled(7)
    spec = get_profile("seed-2026-09").layout(geo, geo.kind(LINEAR)).buffer("weights")
    gp = next(p for p in spec.placements if p.role == "gate_proj")
    assert gp.order[0] == gp.order[15] == 232
    path = pack / f"layer-{LINEAR:02d}.weights.bin"
    data = np.fromfile(path, np.uint8)
    at = gp.offset + 15 * gp.unit_size + 100
    data[at] ^= 0xFF
    data.tofile(path)
    with pytest.raises(VerificationFailed, match="1 placed bytes disagree with another copy"):
        unpack(pack, tmp_path / "back.q4nx", verify_hashes=False)
    with pytest.raises(BadInput, match="sha256 differs"):
        unpack(pack, tmp_path / "back.q4nx")
    assert not (tmp_path / "back.q4nx").exists()
    assert issubclass(VerificationFailed, MoepackError)
