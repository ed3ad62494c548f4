"""``moepack npu`` end to end: exit codes, one-line errors, nothing left behind on failure."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np

from moepack.npu import elf, txn, txn_bd
from moepack.npu.geometry import Geometry
from moepack.npu.q4nx import Q4nxFile, TensorSpec, write_q4nx

from .conftest import FULL, LINEAR


def _leftovers(folder):
    return [p.name for p in folder.iterdir() if "moepack-tmp" in p.name]


def test_synth_pack_map_unpack(cli, model_path, tmp_path):
    r = cli("npu", "synth", tmp_path / "one.q4nx", "--layers", "3", "-q", "--json")
    assert r.code == 0 and json.loads(r.out)["tensors"] == 16
    out = tmp_path / "pack"
    r = cli("npu", "pack", model_path, "--out", out, "--profile", "flm-0.9.46", "-q", "--json")
    assert r.code == 0, r.err
    res = json.loads(r.out)
    assert res["layers"] == [LINEAR, FULL] and len(res["buffers"]) == 6
    doc = json.loads((out / "manifest.json").read_text())
    assert doc["profile"]["name"] == "flm-0.9.46" and doc["model"]["geometry"] == "scaled-7"
    assert doc["model"]["tensor_names"]["status"] == "unverified"
    assert "moepack's guess" in doc["model"]["tensor_names"]["note"]
    for layer in doc["layers"]:
        for b in layer["buffers"]:
            data = (out / b["file"]).read_bytes()
            assert len(data) == b["size"] and hashlib.sha256(data).hexdigest() == b["sha256"]
            assert all(p["status"] and p["source"] for p in b["placements"])
    r = cli("npu", "pack", model_path, "--out", out, "-q")
    assert r.code == 2 and "already holds a pack" in r.one_line_error()
    r = cli("npu", "pack", model_path, "--out", out, "--layers", "3", "--force", "-q")
    assert r.code == 0 and sorted(p.name for p in out.iterdir())[0] == "layer-03.attn_norms.bin"
    r = cli("npu", "unpack", out, "--out", tmp_path / "back.q4nx", "--check", model_path, "-q")
    assert r.code == 0 and "all retained bytes match" in r.out
    (out / "layer-03.router.bin").write_bytes(b"\0" * 40960)
    r = cli("npu", "unpack", out, "--out", tmp_path / "back2.q4nx", "-q")
    assert r.code == 2 and "sha256 differs" in r.one_line_error()
    assert not (tmp_path / "back2.q4nx").exists() and not _leftovers(tmp_path)


def test_map_table_and_json(cli):
    r = cli("npu", "map", "--profile", "seed-2026-09", "--layer", "0")
    assert r.code == 0
    assert "0x9400000" in r.out and "0x1c6fc000" in r.out and "unverified" in r.out
    assert "tensor names: unverified (ref §1" in r.out
    r = cli("npu", "map", "--profile", "flm-0.9.46", "--json")
    m = json.loads(r.out)
    weights = m["buffers"][0]
    assert weights["size"] == 0x1FCB0000 and weights["size_status"] == "verified"
    assert {row["status"] for row in weights["rows"]} == {"verified"}
    r = cli("npu", "map", "--layer", "41")
    assert r.code == 2 and "out of range" in r.one_line_error()
    r = cli("npu", "map", "--profile", "nope")
    assert r.code == 2 and "unknown profile 'nope'" in r.one_line_error()


def test_verify_exit_codes(cli, model_path, packed, tmp_path):
    dump = packed("flm-1.0.x-pool") / f"layer-{LINEAR:02d}.weights.bin"
    r = cli(
        "npu",
        "verify",
        "--dump",
        dump,
        "--model",
        model_path,
        "--layer",
        LINEAR,
        "--profile",
        "auto",
        "--json",
    )
    assert r.code == 0, r.err
    assert json.loads(r.out)["scores"][0]["profile"] == "flm-1.0.x-pool"
    bad = tmp_path / "bad.bin"
    data = bytearray(dump.read_bytes())
    data[4736 * 40 + 3] ^= 0x55
    bad.write_bytes(bytes(data))
    r = cli(
        "npu",
        "verify",
        "--dump",
        bad,
        "--model",
        model_path,
        "--layer",
        LINEAR,
        "--profile",
        "flm-1.0.x",
    )
    line = r.one_line_error()
    assert (
        r.code == 1
        and "1 bytes differ" in line.replace(",", "")
        and "first mismatch at 0x2e403" in line
    )
    assert "matches 99.9999%" in line
    assert "gate_exps_proj.weight, window 2, tile 1" in r.out  # row 40 = gate block 0, i = 8
    r = cli(
        "npu",
        "verify",
        "--dump",
        bad,
        "--model",
        model_path,
        "--layer",
        LINEAR,
        "--buffer",
        "norms",
    )
    assert r.code == 2 and "profile flm-0.9.46's norms buffer" in r.one_line_error()


def test_txn_decode_cli(cli, tmp_path):
    ok = tmp_path / "ok.elf"
    ok.write_bytes(elf.build_elf({".ctrltext": txn.build_stream([txn.op_bd(0x1D000, 4736 // 4),
                                                                  txn.op_patch(0x1D004, 1, 75_776)])}))  # fmt: skip
    r = cli("npu", "txn", "decode", ok, "--all")
    assert r.code == 0 and "arg 1" in r.out and "0x12800" in r.out
    bad = tmp_path / "bad.txn"
    bad.write_bytes(txn.build_stream([txn.op_write(1, 1), b"\x42\0\0\0"]))
    r = cli("npu", "txn", "decode", bad)
    assert r.code == 2 and "unknown opcode 0x42 at byte 0x28" in r.one_line_error()
    assert "WRITE" in r.out  # what decoded before it is still shown
    r = cli("npu", "txn", "decode", tmp_path / "missing.txn")
    assert r.code == 2
    rand = tmp_path / "rand.bin"  # random bytes: refused before any table is printed
    rand.write_bytes(np.random.default_rng(5).bytes(4096))
    r = cli("npu", "txn", "decode", rand)
    assert r.code == 2 and r.out == ""
    assert f"{rand}: not a TXN stream: header word 0 is" in r.one_line_error()
    aie = tmp_path / "aie.txn"  # 8-word MASKWRITEs (aie-rt) and an unpaired patch: warnings
    aie.write_bytes(txn.build_stream([txn.op_maskwrite_aie_rt(0x1D220, 1, 1)] * 2
                                     + [txn.op_patch(0x1D004, 1, 0)]))  # fmt: skip
    r = cli("npu", "txn", "decode", aie)
    assert r.code == 0, r.err
    assert (
        "warning at byte 0x10: MASKWRITE at byte 0x10 (word 4): its Size field says 32 B" in r.out
    )
    assert "(1 more like it)" in r.out and "1 unpaired: region unknown" in r.out
    ref = tmp_path / "lm_head.txn"
    ref.write_bytes(txn.build_stream([txn.op_write(1, 1)] * 42 + [txn.op_tct()]))  # 260 words
    r = cli("npu", "txn", "decode", ref, "--json")
    assert r.code == 0 and json.loads(r.out)["reference"] == [
        {"reference": "lm_head", "identified_by": "stream words", "quantity": "words",
         "expected": 260, "got": 260}
    ]  # fmt: skip


def test_txn_decode_shows_bd_fields_and_json_carries_them(cli, tmp_path):
    fields = {"buffer_length": 2048, "d0_wrap": 32, "d1_wrap": 32, "d1_stepsize": 63,
              "d2_stepsize": 2047, "burst_length": 2, "axcache": 2, "valid_bd": 1}  # fmt: skip
    path = tmp_path / "bd.txn"
    path.write_bytes(txn.build_stream([
        txn.op_bd_fields(0x1D000, fields, "npu1"), txn.op_patch(0x1D004, 0, 16_384),
        txn.op_queue_push(0, 0, "MM2S", 0, 0), txn.op_read_regs([0x04300100], "u64"),
        txn.op_create_scratchpad(4), txn.op_update_reg(0x04300414, 0),
    ], w0=txn.NPU1_W0))  # fmt: skip
    r = cli("npu", "txn", "decode", path, "--all")
    assert r.code == 0, r.err
    for text in ("shim (0,0)", "32×1", "32×64", "d1_stepsize=63", "MM2S 0 ×1", "arg 0 read",
                 "64 spans, 8,192 B", "64-bit addresses", "not a kernel argument",
                 "from its decoded length, d0/d1/d2 wraps and strides"):  # fmt: skip
        assert text in r.out, text
    r = cli("npu", "txn", "decode", path, "--json")
    (s,) = json.loads(r.out)["streams"]
    (bd,) = s["bds"]
    assert bd["fields"] == {f.name: fields.get(f.name, 0) for f in txn_bd.SHIM_BD.fields}
    assert (bd["kind"], bd["bd_id"], bd["direction"], bd["runs"]) == ("shim", 0, "MM2S", 1)
    assert bd["dims"] == [{"wrap": 32, "stride": 1}, {"wrap": 32, "stride": 64},
                          {"wrap": 0, "stride": 2048}]  # fmt: skip
    assert bd["pushes"][0]["channel"] == 0 and s["patches"][0]["access"] == "read"
    assert s["read_regs_forms"] == {"u64": 1} and s["scratchpads"][0]["size"] == 4
    bad = tmp_path / "rr.txn"  # a READ_REGS whose Size fits neither form: one line, exit 2
    bad.write_bytes(txn.build_stream([struct.pack("<5I", 0x82, 20, 1, 0, 0x100)]))
    r = cli("npu", "txn", "decode", bad)
    assert r.code == 2
    assert (f"{bad}: READ_REGS at byte 0x10 (word 4) counts 1 registers in 5 words"
            in r.one_line_error())  # fmt: skip


def _bad_model(path, edit):
    geo = Geometry.scaled()
    specs = {s.name: s for s in geo.layer_specs(LINEAR)}
    edit(specs)
    with open(path, "wb") as fh:
        write_q4nx(fh, specs.values(), lambda s: [np.zeros(s.nbytes, np.uint8)],
                   {"moepack.geometry": geo.name})  # fmt: skip


def test_pack_bad_models_leave_nothing(cli, tmp_path):
    name = f"model.layer.{LINEAR}.linear_attn.ssm_out.weight"
    qkv = f"model.layer.{LINEAR}.linear_attn.qkv_proj.weight"
    cases = {
        "missing": (lambda s: s.pop(name), f"tensor '{name}' is missing (expected I8[64, 16, 8704])"),
        "shape": (lambda s: s.__setitem__(qkv, TensorSpec(qkv, "I8", (256, 8, 9216))),
                  f"tensor '{qkv}' is I8[256, 8, 9216], expected I8[256, 8, 8704]"),
        "dtype": (lambda s: s.__setitem__(qkv, TensorSpec(qkv, "U8", (256, 8, 8704))),
                  f"tensor '{qkv}' is U8[256, 8, 8704], expected I8[256, 8, 8704]"),
    }  # fmt: skip
    for label, (edit, message) in cases.items():
        model = tmp_path / f"{label}.q4nx"
        _bad_model(model, edit)
        out = tmp_path / f"out-{label}"
        r = cli("npu", "pack", model, "--out", out, "-q")
        assert r.code == 2 and message in r.one_line_error(), r.err
        assert not out.exists() and not _leftovers(tmp_path)


def test_pack_truncated_and_overlapping_files(cli, model_path, tmp_path):
    cut = tmp_path / "cut.q4nx"
    with open(model_path, "rb") as fh:
        cut.write_bytes(fh.read(50_000_000))
    r = cli("npu", "pack", cut, "--out", tmp_path / "o1", "-q")
    assert r.code == 2 and "truncated" in r.one_line_error() and not (tmp_path / "o1").exists()
    with Q4nxFile(model_path) as f, open(model_path, "rb") as fh:
        raw = fh.read(f.data_start)
    header = json.loads(raw[8:])
    names = sorted(k for k in header if k != "__metadata__")
    header[names[1]]["data_offsets"][0] -= 64
    header[names[1]]["data_offsets"][1] -= 64
    h = json.dumps(header).encode()
    ov = tmp_path / "overlap.q4nx"
    ov.write_bytes(len(h).to_bytes(8, "little") + h + b"\0" * 200)
    r = cli("npu", "pack", ov, "--out", tmp_path / "o2", "-q")
    assert r.code == 2 and "overlap" in r.one_line_error() and not (tmp_path / "o2").exists()
    r = cli("npu", "pack", model_path, "--out", tmp_path / "o3", "--profile", "flm-9", "-q")
    assert r.code == 2 and "unknown profile 'flm-9'" in r.one_line_error()
    r = cli("npu", "pack", model_path, "--out", tmp_path / "o4", "--layers", "5", "-q")
    assert (
        r.code == 2 and "not in the model" in r.one_line_error() and not (tmp_path / "o4").exists()
    )
