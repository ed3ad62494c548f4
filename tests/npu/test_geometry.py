"""The 35B's tensor table: counts, shapes and sizes from the reference, and file order."""

from __future__ import annotations

import pytest

from moepack.errors import BadInput
from moepack.npu.geometry import Geometry, LayerKind, check_tensors, detect, parse_layers
from moepack.npu.q4nx import Q4nxFile


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
