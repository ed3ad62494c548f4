"""One regression test per input class that once escaped as a traceback, a hang, a runaway
allocation or a silent wrong answer (issue 8), each through the real CLI in process."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from harness import moetrace_seal

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.synth import synth_model
from moepack.layout.plan import LayerPlan, Plan, save_plan
from moepack.storage.surface import PEER_FORMAT, Surface, SurfaceCell
from moepack.trace import load_trace, save_trace, synth_trace

DEEP = "[" * 3000 + "0" + "]" * 3000


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A tiny model, its trace in every format, a plan in both formats and two surfaces."""
    d = tmp_path_factory.mktemp("known")
    model = synth_model(d / "m.gguf", tiny_spec()).paths[0]
    with MoeModel(model) as m:
        trace = synth_trace(m, tokens=32, seed=3)
        plan = Plan([LayerPlan(b.index, np.arange(b.n_expert)[::-1].copy()) for b in m.blocks],
                    m.fingerprint)  # fmt: skip
    out = {"model": model}
    for ext in ("moetrace", "pmxtrace", "csv", "txt"):
        out[ext] = d / f"t.{ext}"
        save_trace(trace, out[ext])
    for ext in ("moeplan", "pmxplan"):
        out[ext] = d / f"p.{ext}"
        save_plan(plan, out[ext])
    s = Surface([SurfaceCell(4096, 1, 1e8), SurfaceCell(65536, 4, 9e8)], engine="pread")
    out["surface"] = s.save(d / "s.json")
    out["peer"] = s.save(d / "peer.json", PEER_FORMAT)
    return out


def one_error_line(err: str, *needles: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("moepack: error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# ------------------------------------------------------------------ route CSV
def _edit_field(text: bytes, column: int, value: bytes) -> bytes:
    """The route CSV ``text`` with ``column`` of its first routing row set to ``value``."""
    lines = text.split(b"\n")
    row = next(i for i, ln in enumerate(lines) if ln[:1].isdigit())
    fields = lines[row].split(b",")
    fields[column] = value
    lines[row] = b",".join(fields)
    return b"\n".join(lines)


@pytest.mark.parametrize(
    ("column", "value", "code", "needle"),
    [
        (6, b"0.\xff5", 2, "is not UTF-8 text"),
        (2, b"9" * 20, 2, "out of range"),
        (6, b"5" * 140_000, 0, ""),  # over csv's default 131,072 characters, a valid float
        (0, b'"' + b"5" * (2 << 20) + b'"', 2, "not CSV (field larger than field limit"),
    ],
    ids=["non-utf8", "20-digit", "140k-field", "2MiB-field"],
)
def test_route_csv_edge_bytes(capsys, files, tmp_path, column, value, code, needle):
    bad = tmp_path / "bad.csv"
    bad.write_bytes(_edit_field(files["csv"].read_bytes(), column, value))
    got, _, err = run_cli(capsys, "trace", "info", bad)
    assert got == code, err
    if code:
        one_error_line(err, needle)
    else:
        assert "Traceback" not in err and len(err.splitlines()) <= 1


def test_route_csv_sparse_tokens_do_not_allocate_their_product(capsys, tmp_path):
    """3,000 tokens each on its own layer once needed a 3,000 × 3,000 × k table."""
    rows = "".join(f"0,1,{t},{t},{s},{s},0.5\n" for t in range(3000) for s in range(2))
    bad = tmp_path / "sparse.csv"
    bad.write_text(
        "# route_trace v1\n# model=x arch=qwen3moe n_layer=3000 n_expert=8 n_expert_used=2\n"
        "turn,phase,step,layer,slot,expert,weight\n" + rows
    )
    code, _, err = run_cli(capsys, "trace", "info", bad)
    assert code == 2
    one_error_line(err, "has no routing for layer")


# ------------------------------------------------------------------ deep JSON, huge integers
def test_deep_json_in_a_plan_a_surface_and_a_moetrace_header(capsys, files, tmp_path):
    plan = tmp_path / "deep.moeplan"
    doc = json.loads(files["moeplan"].read_text())
    doc["source"] = "DEEP"
    plan.write_text(json.dumps(doc).replace('"DEEP"', DEEP))
    code, _, err = run_cli(capsys, "repack", files["model"], "--plan", plan, "--out",
                           tmp_path / "o.gguf")  # fmt: skip
    assert code == 2
    one_error_line(err, "nested too deeply")

    surface = tmp_path / "deep.json"
    surface.write_text(files["surface"].read_text().replace('"note": ""', f'"note": {DEEP}'))
    code, _, err = run_cli(capsys, "surface", "show", surface)
    assert code == 2
    one_error_line(err, "nested too deeply")

    raw = files["moetrace"].read_bytes()
    (hlen,) = struct.unpack_from("<I", raw, 12)
    header = json.loads(raw[20 : 20 + hlen])
    header["provenance"] = {"deep": "DEEP"}
    sealed = moetrace_seal(json.dumps(header).replace('"DEEP"', DEEP).encode(), raw[20 + hlen :])
    deep = tmp_path / "deep.moetrace"
    deep.write_bytes(sealed)
    code, _, err = run_cli(capsys, "trace", "info", deep)
    assert code == 2
    one_error_line(err, "nested too deeply")


def test_permutation_entry_of_ten_to_the_thirty(capsys, files, tmp_path):
    doc = json.loads(files["moeplan"].read_text())
    doc["layers"][0]["perm"][0] = 10**30
    native = tmp_path / "big.moeplan"
    native.write_text(json.dumps(doc))
    peer = tmp_path / "big.pmxplan"
    text = files["pmxplan"].read_text()
    peer.write_text(text.replace("perm 7,", f"perm {10**30},", 1))
    assert peer.read_text() != text
    for plan in (native, peer):
        code, _, err = run_cli(capsys, "repack", files["model"], "--plan", plan, "--out",
                               tmp_path / "o.gguf")  # fmt: skip
        assert code == 2
        one_error_line(err, str(plan))
    assert not (tmp_path / "o.gguf").exists()


@pytest.mark.parametrize(
    ("field", "value"), [("device", 1), ("engine", 8), ("mode", ["a"]), ("cache_bypassed", "y")]
)
def test_surface_fields_of_the_wrong_type(capsys, files, tmp_path, field, value):
    doc = json.loads(files["surface"].read_text())
    doc[field] = value
    bad = tmp_path / "typed.json"
    bad.write_text(json.dumps(doc))
    code, _, err = run_cli(capsys, "surface", "show", bad)
    assert code == 2
    one_error_line(err, f"'{field}' must be")


def test_peer_surface_note_of_the_wrong_type(capsys, files, tmp_path):
    doc = json.loads(files["peer"].read_text())
    doc["note"] = {"a": 1}
    bad = tmp_path / "peer-typed.json"
    bad.write_text(json.dumps(doc))
    code, _, err = run_cli(capsys, "surface", "show", bad)
    assert code == 2
    one_error_line(err, "'note' must be")


# ------------------------------------------------------------------ declared counts
@pytest.mark.parametrize("n_experts", [134_217_736, 0xFFFFFFFE])
def test_pmxtrace_expert_count_is_checked_before_allocating(capsys, files, tmp_path, n_experts):
    raw = bytearray(files["pmxtrace"].read_bytes())
    struct.pack_into("<I", raw, 16, n_experts)
    bad = tmp_path / "flipped.pmxtrace"
    bad.write_bytes(raw)
    code, _, err = run_cli(capsys, "trace", "info", bad)
    assert code == 2
    one_error_line(err, f"{n_experts:,} experts")


def test_moetrace_shape_is_checked_before_mapping(capsys, files, tmp_path):
    raw = files["moetrace"].read_bytes()
    (hlen,) = struct.unpack_from("<I", raw, 12)
    header = json.loads(raw[20 : 20 + hlen])
    header["shape"][1] = 1 << 40
    body = raw[20 + hlen :]
    header["body"]["crc32"] = f"{zlib.crc32(body):08x}"
    bad = tmp_path / "wide.moetrace"
    bad.write_bytes(moetrace_seal(json.dumps(header).encode(), body))
    code, _, err = run_cli(capsys, "trace", "info", bad)
    assert code == 2
    one_error_line(err, "layers")


# ------------------------------------------------------------------ files that are not files
def _cli_in_child(*args: object, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``moepack ARGS`` in a child, so that a reader that blocks fails the test by timeout
    instead of hanging the session."""
    code = "import sys; from moepack.cli.main import main; main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


@pytest.mark.parametrize(
    "args",
    [["trace", "info", "--format", "text"], ["npu", "txn", "decode"], ["surface", "show"],
     ["trace", "info"]],
    ids=["trace-text", "txn", "surface", "trace-detect"],
)  # fmt: skip
def test_a_fifo_is_refused_not_waited_on(tmp_path, args):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    r = _cli_in_child(*args, fifo)
    assert r.returncode == 2
    one_error_line(r.stderr, "FIFO")


@pytest.mark.parametrize("args", [["npu", "txn", "decode"], ["surface", "show"]])
def test_dev_zero_is_refused_not_read_to_the_end(capsys, args):
    code, _, err = run_cli(capsys, *args, "/dev/zero")
    assert code == 2
    one_error_line(err, "/dev/zero", "character device")


# ------------------------------------------------------------------ npu verify --locate
def test_locate_on_a_dump_a_few_bytes_short(tmp_path):
    """The shortened unit was compared with a full-length slice of the model (a broadcast
    error), and the map could not be closed under the traceback (BufferError)."""
    from moepack.npu.geometry import Geometry, detect
    from moepack.npu.packer import layer_plan, pack_buffer
    from moepack.npu.profiles import get_profile
    from moepack.npu.q4nx import Q4nxFile, TensorSpec, write_q4nx
    from moepack.npu.synth import produce
    from moepack.npu.verify import verify_dump

    geo, layer, profile = Geometry.scaled(1), 3, "seed-2026-09"
    roles = get_profile(profile).layout(geo, geo.kind(layer)).roles()
    model = tmp_path / "tiny.q4nx"
    specs = [TensorSpec(geo.name_of(r, layer), geo.shape(r).dtype, geo.shape(r).shape)
             for r in roles]  # fmt: skip
    with open(model, "wb") as fh:
        write_q4nx(fh, specs, lambda s: produce(s, 1), {"moepack.geometry": geo.name})
    with Q4nxFile(model) as m:
        buf = np.array(pack_buffer(m, layer_plan(m, get_profile(profile), detect(m), layer)
                                   .buffer("weights")))  # fmt: skip
    buf[100:200] ^= 0x5A  # a mismatch to locate, then cut the last unit short
    dump = tmp_path / "short.bin"
    buf[:-3].tofile(dump)
    res = verify_dump(dump, model, layer, profile="auto", locate_first=3)
    assert res.dump_size == buf.size - 3
    assert any(s.mismatches for s in res.scores)


# ------------------------------------------------------------------ silent wrong answers
def test_shape_only_bindings_are_said_and_recorded(capsys, files, tmp_path):
    code, out, err = run_cli(capsys, "plan", files["model"], "--trace", files["pmxtrace"],
                             "--out", tmp_path / "p.moeplan", "--json")  # fmt: skip
    assert code == 0
    warning = [ln for ln in err.splitlines() if ln.strip()]
    assert len(warning) == 1 and warning[0].startswith("moepack: warning: "), err
    assert "shape only" in warning[0] and str(files["pmxtrace"]) in warning[0]
    assert json.loads((tmp_path / "p.moeplan").read_text())["trace_binding"] == "shape"
    assert json.loads(out)["warnings"] == [warning[0].removeprefix("moepack: warning: ")]

    code, _, err = run_cli(capsys, "plan", files["model"], "--trace", files["moetrace"],
                           "--out", tmp_path / "q.moeplan")  # fmt: skip
    assert code == 0 and "warning" not in err
    assert json.loads((tmp_path / "q.moeplan").read_text())["trace_binding"] == "fingerprint"

    code, out, err = run_cli(capsys, "repack", files["model"], "--plan", files["pmxplan"],
                             "--out", tmp_path / "r.gguf", "--json", "-q")  # fmt: skip
    assert code == 0 and "shape only" in err and json.loads(out)["plan_binding"] == "shape"

    code, _, err = run_cli(capsys, "trace", "convert", files["csv"], tmp_path / "c.moetrace",
                           "--model", files["model"])  # fmt: skip
    assert code == 0 and "shape only" in err
    assert load_trace(tmp_path / "c.moetrace").provenance["binding"] == "shape"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["repack", "{model}", "--plan", "{moeplan}", "--out", "{tmp}/other.moeplan"],
         "'.moeplan' is for a plan"),
        (["plan", "{model}", "--trace", "{moetrace}", "--out", "{tmp}/x.pmxtrace"],
         "'.pmxtrace' is for a routing trace"),
        (["trace", "convert", "{moetrace}", "{tmp}/t.gguf", "--to", "moetrace"],
         "'.gguf' is for a GGUF model"),
        (["synth", "--out", "{tmp}/m.q4nx"], "'.q4nx' is for a .q4nx model"),
    ],
    ids=["repack", "plan", "convert", "synth"],
)  # fmt: skip
def test_an_output_named_for_another_kind_of_file_is_refused(capsys, files, tmp_path, args,
                                                             needle):  # fmt: skip
    names = {k: str(v) for k, v in files.items()} | {"tmp": str(tmp_path)}
    code, _, err = run_cli(capsys, *[a.format(**names) for a in args])
    assert code == 2
    one_error_line(err, needle)
    assert [p.name for p in tmp_path.iterdir()] == []


def test_npu_synth_keeps_an_existing_q4nx_without_force(capsys, tmp_path):
    out = tmp_path / "m.q4nx"
    out.write_bytes(b"a model that took a day to download")
    code, _, err = run_cli(capsys, "npu", "synth", out, "--layers", "3")
    assert code == 2
    one_error_line(err, "--force")
    assert out.read_bytes() == b"a model that took a day to download"
    code, _, err = run_cli(capsys, "npu", "synth", out, "--layers", "3", "--force", "-q")
    assert code == 0, err
    assert out.read_bytes() != b"a model that took a day to download"


def test_messages_that_used_to_mislead(capsys, files, tmp_path):
    code, _, err = run_cli(capsys, "plan", files["model"], "--trace", files["moetrace"],
                           "--out", tmp_path / "same.png", "--map", tmp_path / "same.png")  # fmt: skip
    assert code == 2
    one_error_line(err, "--out and --map name the same file")

    code, _, err = run_cli(capsys, "repack", files["model"], "--plan", tmp_path, "--out",
                           tmp_path / "o.gguf")  # fmt: skip
    assert code == 2
    one_error_line(err, "is a folder, not a plan file")

    odd = tmp_path / "new\nline.moeplan"
    code, _, err = run_cli(capsys, "repack", files["model"], "--plan", odd, "--out",
                           tmp_path / "o.gguf")  # fmt: skip
    assert code == 2
    one_error_line(err, "new\\nline.moeplan", "no such plan file")
