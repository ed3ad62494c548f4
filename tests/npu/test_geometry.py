"""The 35B's tensor table: counts, shapes and sizes from the reference, and file order."""

from __future__ import annotations

import json

import pytest

from moepack.errors import BadInput
from moepack.npu.geometry import Geometry, LayerKind, check_tensors, detect, parse_layers
from moepack.npu.q4nx import Q4nxFile, TensorSpec

from .conftest import TINY_LAYER, sparse_model


def test_full_model_tensor_counts():
    geo = Geometry.full()
    specs = geo.model_specs()
    assert len(specs) == 733
    assert sum(s.name.endswith(".weight") for s in specs) == 673
    suffixless = [s.name for s in specs if not s.name.endswith(".weight")]
    assert len(suffixless) == 60 and all(n.endswith(("ssm_a", "ssm_dt.bias")) for n in suffixless)
    assert all(
        s.name.startswith(("model.layer.", "model.embed", "model.norm", "lm_head")) for s in specs
    )


def test_full_attention_every_fourth_layer():
    geo = Geometry.full()
    full = [layer for layer in range(40) if geo.kind(layer) == LayerKind.FULL]
    assert full == list(range(3, 40, 4)) and len(full) == 10


def test_reference_shapes_and_sizes():
    s = Geometry.full().shape
    for role in ("up_exps", "gate_exps"):
        assert s(role).shape == (4096, 8, 5120)
    assert s("down_exps").shape == (16384, 2, 5120)
    for role in ("up_exps", "gate_exps", "down_exps"):
        assert s(role).n_tiles == 32768 and s(role).nbytes == 167_772_160
    assert (s("qkv").shape, s("qkv").n_tiles) == ((256, 8, 8704), 2048)
    assert (s("ssm_out").shape, s("ssm_out").n_tiles) == ((64, 16, 8704), 1024)
    assert (s("gate_proj").shape, s("gate_proj").n_tiles) == ((128, 8, 8704), 1024)
    assert s("share_up").n_tiles == s("share_gate").n_tiles == 128 and s("share_up").h == 8
    assert (s("share_down").shape, s("share_down").h) == ((64, 2, 8704), 2)
    assert s("ssm_a").text() == "F32[32]" and s("ssm_dt_bias").text() == "F32[32]"
    assert (
        s("ssm_conv1d").text() == "BF16[4, 8192]" and s("shared_expert_gate").text() == "BF16[2048]"
    )
    assert s("moe_router").nbytes == 1024 * 1024
    head = sum(
        s(r).nbytes
        for r in ("ssm_conv1d", "ssm_norm", "ssm_a", "ssm_dt_bias", "ssm_alpha", "ssm_beta")
    )
    assert head == 328_192
    assert s("q_norm").nbytes == s("k_norm").nbytes == 512


def test_synthetic_file_order_and_detection(model_path):
    with Q4nxFile(model_path) as f:
        geo = detect(f)
        assert (
            geo.name == "scaled-7"
            and geo.kind(2) == LayerKind.LINEAR
            and geo.kind(3) == LayerKind.FULL
        )
        names = sorted(f.entries, key=lambda n: f.entries[n].begin)
        assert names == sorted(names)  # data laid out alphabetically, like the runtime's files
        # the neighbours behind the seed's boundary-crossing rows
        i = names.index("model.layer.2.mlp.up_exps_proj.weight")
        assert names[i - 1] == "model.layer.2.mlp.share_up_proj.weight"
        j = names.index("model.layer.2.mlp.gate_exps_proj.weight")
        assert names[j - 1] == "model.layer.2.mlp.down_exps_proj.weight"
        assert f.entries[names[i - 1]].end == f.entries[names[i]].begin
        check_tensors(f, geo, 2, list(geo.roles(LayerKind.LINEAR)))
        with pytest.raises(
            BadInput, match=r"'model\.layer\.3\.linear_attn\.qkv_proj\.weight' is missing"
        ):
            check_tensors(f, geo, 3, ["qkv"])


def test_parse_layers():
    assert parse_layers("0-3,7, 5") == [0, 1, 2, 3, 5, 7]
    assert parse_layers(None, [2, 3]) == [2, 3]
    for bad, msg in (("3-1", "reversed"), ("x", "not N or N-M"), ("4", r"not in the model")):
        with pytest.raises(BadInput, match=msg):
            parse_layers(bad, [2, 3])
    with pytest.raises(BadInput, match="out of range"):
        parse_layers("40", None, 40)


def test_geometry_names_are_bounded():
    assert Geometry.named("scaled-256").n_experts == 256 and Geometry.named("scaled").n_experts == 7
    for bad, msg in (("scaled-0", "out of range"), ("scaled-257", "out of range"),
                     ("scaled-" + "9" * 5000, "unknown geometry"), (7, "unknown geometry 7"),
                     ("huge", "unknown geometry 'huge'")):  # fmt: skip
        with pytest.raises(BadInput, match=msg):
            Geometry.named(bad)


def test_metadata_is_bounded_and_cross_checked(tmp_path):
    one = [TensorSpec("model.layer.0.x", "U8", (1,))]
    lie = sparse_model(tmp_path / "lie.q4nx", one, {"moepack.geometry": "scaled-200000000"})
    with Q4nxFile(lie) as f, pytest.raises(BadInput, match="metadata 'moepack.geometry': unknown"):
        detect(f)  # refused before anything is sized from it (was a 6 GiB allocation)
    big = sparse_model(tmp_path / "big.q4nx", one, {"moepack.geometry": "scaled-9999"})
    with Q4nxFile(big) as f, pytest.raises(BadInput, match="9999 is out of range"):
        detect(f)
    specs = Geometry.scaled(7).layer_specs(2)
    other = sparse_model(tmp_path / "other.q4nx", specs, {"moepack.geometry": "scaled-9"})
    with (
        Q4nxFile(other) as f,
        pytest.raises(
            BadInput, match=r"says scaled-9 \(9 experts\), but the tensors say 7 experts \('model"
        ),
    ):
        detect(f)
    for meta in ({"moepack.geometry": "scaled-7"}, None):
        ok = sparse_model(tmp_path / "ok.q4nx", specs, meta)
        with Q4nxFile(ok) as f:
            assert detect(f).name == "scaled-7"


def test_one_bad_tensor_is_the_one_blamed_and_every_problem_is_named(tmp_path, cli):
    geo = Geometry.scaled(7)
    specs = {s.name: s for layer in (2, 3) for s in geo.layer_specs(layer)}
    up, qkv = geo.name_of("up_exps", 2), geo.name_of("qkv", 2)
    ssm_a, o_proj = geo.name_of("ssm_a", 2), geo.name_of("o_proj", 3)
    specs[up] = TensorSpec(up, "I8", (96, 8, 5120))  # 6 experts' worth; gate/down/router say 7
    specs[qkv] = TensorSpec(qkv, "I8", (256, 8, 9216))
    specs[o_proj] = TensorSpec(o_proj, "BF16", (2048, 4096))
    del specs[ssm_a]
    bad = sparse_model(tmp_path / "bad.q4nx", specs.values())  # no metadata: shapes decide
    with Q4nxFile(bad) as f:
        assert detect(f).name == "scaled-7"
    r = cli("npu", "pack", bad, "--out", tmp_path / "out", "-q")
    line = r.one_line_error()
    assert r.code == 2 and "4 tensor problems: " in line
    assert f"'{up}' is I8[96, 8, 5120], expected I8[112, 8, 5120]" in line
    assert f"'{qkv}' is I8[256, 8, 9216], expected I8[256, 8, 8704]" in line
    assert f"'{ssm_a}' is missing (expected F32[32])" in line and f"'{o_proj}' is BF16" in line
    assert "gate_exps" not in line and "down_exps" not in line and "moe_router" not in line
    assert not (tmp_path / "out").exists()
    gate = geo.name_of("gate_exps", 2)  # now two tensors say 6 and two say 7: no majority
    specs[gate] = TensorSpec(gate, "I8", (96, 8, 5120))
    for layer in (3,):
        for role in ("up_exps", "gate_exps", "down_exps", "moe_router"):
            specs.pop(geo.name_of(role, layer))
    tie = sparse_model(tmp_path / "tie.q4nx", specs.values())
    with Q4nxFile(tie) as f, pytest.raises(BadInput, match="cannot tell the expert count: "):
        detect(f)


def test_profile_that_cannot_lay_out_a_geometry_is_a_clean_error(cli, tiny_model, tmp_path):
    """v1.0.x's down windows come in groups of 8: one expert gives 138 windows."""
    r = cli("npu", "pack", tiny_model, "--out", tmp_path / "o", "--profile", "flm-1.0.x-pool")
    line = r.one_line_error()
    assert (
        r.code == 2
        and (
            "profile flm-1.0.x-pool cannot lay out a full-attention layer of geometry scaled-1: "
            "138 units are not whole groups of 8"
        )
        in line
    )
    r = cli("npu", "map", "--geometry", "scaled-1", "--profile", "flm-1.0.x", "--layer", "0")
    assert r.code == 2 and "cannot lay out a linear-attention layer" in r.one_line_error()
    dump = tmp_path / "dump.bin"
    dump.write_bytes(b"\0" * (0x3000 + 2048 * 2))  # a router buffer's size at one expert
    r = cli("npu", "verify", "--dump", dump, "--model", tiny_model, "--layer", TINY_LAYER,
            "--profile", "auto", "--buffer", "router", "--json")  # fmt: skip
    assert r.code == 1 and "Traceback" not in r.err
    reasons = {s["profile"]: s["reason"] for s in json.loads(r.out)["scores"]}
    assert "138 units are not whole groups of 8" in reasons["flm-1.0.x-pool"]
