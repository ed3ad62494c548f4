"""``moepack trace`` through the real entry point: results, JSON, and every bad input as a
one-line error with exit 2 and no partial output."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moefixtures import run_cli
from moepack.checkpoint import MoeModel
from moepack.trace import RoutingTrace, load_trace, save_trace, synth_truth


def one_line_error(err: str, *needles: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("moepack: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if "moepack-tmp" in p.name)


@pytest.fixture
def bound(tmp_path, model_path, capsys) -> Path:
    """A synthetic trace for the tiny model, in the native format."""
    out = tmp_path / "t.moetrace"
    code, _, err = run_cli(
        capsys,
        "trace",
        "synth",
        str(out),
        "--model",
        str(model_path),
        "--tokens",
        "300",
        "--prefill",
        "20",
        "--weights",
        "-q",
    )
    assert code == 0, err
    return out


def test_synth_for_a_model_then_info(capsys, bound, model_path):
    code, out, _ = run_cli(
        capsys, "trace", "info", str(bound), "--model", str(model_path), "--json"
    )
    assert code == 0
    j = json.loads(out)
    assert (j["tokens"], j["prefill_tokens"], j["layers"], j["k"], j["n_expert"]) == (
        300,
        20,
        3,
        2,
        8,
    )
    assert j["weights"] is True and j["format"] == "moetrace"
    assert j["binding"]["fingerprint_matches"] is True and j["binding"]["blocks"] == [0, 1, 2]
    assert len(j["per_layer"]) == 3 and set(j["phases"]) == {"prefill", "decode"}
    assert j["provenance"]["synth"]["cluster_of"] == "[3 layers x 8 experts]"
    code, out, _ = run_cli(capsys, "trace", "info", str(bound), "--model", str(model_path))
    assert code == 0
    assert "fits model" in out and "fingerprint matches" in out and "per layer" in out
    truth = synth_truth(load_trace(bound))
    assert truth is not None and truth.cluster_of.shape == (3, 8)


def test_synth_for_explicit_sizes(capsys, tmp_path):
    out = tmp_path / "s.pmxtrace"
    code, stdout, _ = run_cli(
        capsys,
        "trace",
        "synth",
        str(out),
        "--layers",
        "4",
        "--experts",
        "32",
        "--top-k",
        "4",
        "--tokens",
        "500",
        "--persistence",
        "0.5",
        "--seed",
        "3",
        "--json",
    )
    assert code == 0
    j = json.loads(stdout)
    assert j["output"]["format"] == "pmxtrace" and j["output"]["version"] == 2
    assert any("provenance" in d for d in j["output"]["dropped"])
    assert j["params"]["persistence"] == 0.5
    t = load_trace(out)
    assert t.ids.shape == (500, 4, 4) and t.n_expert == 32


def test_convert_reports_drops_and_binds(capsys, tmp_path, bound, model_path):
    code, out, _ = run_cli(
        capsys, "trace", "convert", str(bound), str(tmp_path / "v1.pmxtrace"), "--pmx-version", "1"
    )
    assert code == 0
    assert "dropped" in out and "router weights" in out and "prefill/decode split" in out
    raw = (tmp_path / "v1.pmxtrace").read_bytes()
    assert raw[:8] == b"PMXTRACE" and struct.unpack_from("<I", raw, 8)[0] == 1
    # back to native, bound to the model again
    code, out, _ = run_cli(
        capsys,
        "trace",
        "convert",
        str(tmp_path / "v1.pmxtrace"),
        str(tmp_path / "back.moetrace"),
        "--model",
        str(model_path),
        "--json",
    )
    assert code == 0
    j = json.loads(out)
    assert j["bound_to"] == str(model_path) and j["output"]["dropped"] == []
    back = load_trace(tmp_path / "back.moetrace")
    with MoeModel(model_path) as m:
        assert back.model_fingerprint == m.fingerprint and back.block_map == [0, 1, 2]
    assert np.array_equal(back.ids, load_trace(bound).ids)


def test_convert_text_with_n_expert_and_block_map(capsys, tmp_path, model_path):
    p = tmp_path / "peer.txt"
    p.write_text("0 0 1 2\n0 1 3 4\n1 0 5 6\n1 1 7 0\n")
    code, _, err = run_cli(capsys, "trace", "convert", str(p), str(tmp_path / "x.moetrace"))
    assert code == 2
    one_line_error(err, "does not say how many experts", "--n-expert")
    assert not (tmp_path / "x.moetrace").exists()
    code, _, err = run_cli(
        capsys, "trace", "convert", str(p), str(tmp_path / "x.moetrace"), "--model", str(model_path)
    )
    assert code == 2
    one_line_error(
        err, "has no block map, and", "3 MoE blocks (0-2) vs 2 trace layers", "give --block-map"
    )
    code, out, err = run_cli(
        capsys,
        "trace",
        "convert",
        str(p),
        str(tmp_path / "x.moetrace"),
        "--model",
        str(model_path),
        "--block-map",
        "0,2",
    )
    assert code == 0, err
    t = load_trace(tmp_path / "x.moetrace")
    assert t.block_map == [0, 2] and t.n_expert == 8
    code, out, _ = run_cli(
        capsys, "trace", "convert", str(p), str(tmp_path / "y.txt"), "--n-expert", "8"
    )
    assert code == 0
    assert (tmp_path / "y.txt").read_text().endswith("0 0 1 2\n0 1 3 4\n1 0 5 6\n1 1 7 0\n")


def test_formats_json(capsys):
    code, out, _ = run_cli(capsys, "trace", "formats", "--json")
    assert code == 0
    names = {r["name"] for r in json.loads(out)}
    assert names == {"moetrace", "pmxtrace", "text", "routecsv", "mblt"}


# ------------------------------------------------------------------ bad input
def _pmx(tmp_path: Path, raw: bytes) -> Path:
    p = tmp_path / "in.pmxtrace"
    p.write_bytes(raw)
    return p


def _good_pmx(layers=3, experts=8, k=2, tokens=4, body=None) -> bytes:
    head = struct.pack("<8sIIIIQQ", b"PMXTRACE", 2, layers, experts, k, tokens, 0)
    if body is None:
        body = np.tile(np.array([0, 1], "<u4"), tokens * layers)
    return head + np.asarray(body, "<u4").tobytes()


BAD_FILES = {
    "truncated": (lambda: _good_pmx()[:-2], "in.pmxtrace", ["truncated"]),
    "wrong magic": (lambda: b"PMXTRACZ" + _good_pmx()[8:], "in.pmxtrace", ["magic"]),
    "unsupported version": (
        lambda: _good_pmx()[:8] + struct.pack("<I", 9) + _good_pmx()[12:],
        "in.pmxtrace",
        ["unsupported pmxtrace version 9"],
    ),
    "id out of range": (
        lambda: _good_pmx(body=[0, 1] * 11 + [0, 8]),
        "in.pmxtrace",
        ["expert id 8 is out of range"],
    ),
    "duplicate text row": (
        lambda: b"0 0 1 2\n0 1 1 2\n0 0 3 4\n",
        "in.txt",
        ["token 0 layer 0 appears twice (lines 1 and 3)"],
    ),
    "missing text row": (lambda: b"0 0 1 2\n0 1 1 2\n1 1 3 4\n", "in.txt", ["token 1 layer 0"]),
    "inconsistent k": (lambda: b"0 0 1 2\n0 1 1 2 3\n", "in.txt", ["line 2: 3 experts"]),
    "corrupt native": (lambda: None, "in.moetrace", ["checksum mismatch"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
@pytest.mark.parametrize("command", ["info", "convert"])
def test_bad_input_one_line_exit_2_no_output(capsys, tmp_path, rich_trace, case, command):
    make, name, needles = BAD_FILES[case]
    src = tmp_path / name
    if case == "corrupt native":
        raw = bytearray(save_trace(rich_trace, src).path.read_bytes())
        raw[-5] ^= 0xFF
        src.write_bytes(bytes(raw))
    else:
        src.write_bytes(make())
    before = src.read_bytes()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = ["trace", command, str(src)]
    if command == "convert":
        args.append(str(out_dir / "o.moetrace"))
    code, _, err = run_cli(capsys, *args, "--n-expert", "8")
    assert code == 2
    one_line_error(err, str(src), *needles)
    assert list(out_dir.iterdir()) == [] and leftovers(tmp_path) == []
    assert src.read_bytes() == before


def test_trace_for_another_model(capsys, tmp_path, bound, other_model_path):
    code, _, err = run_cli(capsys, "trace", "info", str(bound), "--model", str(other_model_path))
    assert code == 2
    one_line_error(err, "trace belongs to the model with fingerprint", "another model")
    code, _, err = run_cli(
        capsys,
        "trace",
        "convert",
        str(bound),
        str(tmp_path / "x.pmxtrace"),
        "--model",
        str(other_model_path),
    )
    assert code == 2
    one_line_error(err, "another model")
    assert not (tmp_path / "x.pmxtrace").exists()


def test_block_map_naming_a_non_moe_block(capsys, tmp_path, model_path):
    t = RoutingTrace(ids=np.array([[[0, 1], [2, 3]]], np.uint8), n_expert=8, block_map=[1, 7])
    src = save_trace(t, tmp_path / "bm.moetrace").path
    code, _, err = run_cli(capsys, "trace", "info", str(src), "--model", str(model_path))
    assert code == 2
    one_line_error(err, "block 7, which is not a MoE block", "MoE blocks: 0-2")
    code, _, err = run_cli(
        capsys,
        "trace",
        "convert",
        str(src),
        str(tmp_path / "o.txt"),
        "--model",
        str(model_path),
        "--block-map",
        "0,9",
    )
    assert code == 2
    one_line_error(err, "block 9, which is not a MoE block")
    assert not (tmp_path / "o.txt").exists()


def test_output_errors(capsys, tmp_path, bound):
    code, _, err = run_cli(capsys, "trace", "convert", str(bound), str(bound))
    assert code == 2
    one_line_error(err, "output would overwrite the input")
    code, _, err = run_cli(capsys, "trace", "convert", str(bound), str(tmp_path / "nope" / "x.txt"))
    assert code == 2
    one_line_error(err, "output folder", "does not exist")
    code, _, err = run_cli(capsys, "trace", "convert", str(bound), str(tmp_path / "x.bin"))
    assert code == 2
    one_line_error(err, "could not be told from the extension '.bin'", "name it with --to")
    code, _, err = run_cli(
        capsys, "trace", "convert", str(bound), str(tmp_path / "x.txt"), "--strict"
    )
    assert code == 2
    one_line_error(err, "text v1 cannot carry: router weights")
    code, _, err = run_cli(
        capsys, "trace", "convert", str(bound), str(tmp_path / "x.txt"), "--pmx-version", "1"
    )
    assert code == 2
    one_line_error(err, "--pmx-version applies only to pmxtrace output")
    code, _, err = run_cli(
        capsys, "trace", "convert", str(bound), str(tmp_path / "x.csv"), "--to", "text"
    )
    assert code == 0  # --to wins over the extension
    assert load_trace(tmp_path / "x.csv", format="text").tokens == 300
    assert leftovers(tmp_path) == []


def test_hints_name_only_options_the_command_has(capsys, tmp_path, model_path):
    """The library says what is missing; each command adds the option it has for it."""
    unknown = tmp_path / "zero.gguf"
    unknown.write_bytes(bytes(64))
    code, _, err = run_cli(capsys, "trace", "info", str(unknown))
    assert code == 2
    one_line_error(err, "trace format could not be detected", "name it with --format")
    code, _, err = run_cli(capsys, "trace", "convert", str(unknown), str(tmp_path / "o.txt"))
    assert code == 2
    one_line_error(err, "trace format could not be detected", "name it with --from")
    assert "--format" not in err
    # `plan` has no --format: it gets the plain statement of what is missing
    code, _, err = run_cli(
        capsys, "plan", str(model_path), "--trace", str(unknown), "--out", str(tmp_path / "p")
    )
    assert code == 2
    one_line_error(err, "trace format could not be detected")
    assert "--" not in err
    # synth refuses an unknown output format before synthesising anything
    code, _, err = run_cli(
        capsys, "trace", "synth", str(tmp_path / "s.bin"), "--model", str(model_path)
    )
    assert code == 2
    one_line_error(err, "could not be told from the extension '.bin'", "name it with --to")
    code, _, err = run_cli(
        capsys,
        "trace",
        "synth",
        str(tmp_path / "s.csv"),
        *("--layers", "2", "--experts", "8", "--top-k", "2", "-q"),
    )
    assert code == 2
    one_line_error(err, "has no block map to say which blocks", "give --model, or --block-map")
    text = tmp_path / "peer.txt"
    text.write_text("0 0 1 2\n0 1 3 4\n1 0 5 6\n1 1 7 0\n")
    code, _, err = run_cli(capsys, "trace", "info", str(text))
    assert code == 2
    one_line_error(err, "does not say how many experts", "pass --n-expert N or --model MODEL")
    code, _, err = run_cli(capsys, "trace", "convert", str(text), str(tmp_path / "o.csv"))
    assert code == 2
    one_line_error(err, "does not say how many experts", "pass --n-expert N")
    code, _, err = run_cli(
        capsys, "trace", "convert", str(text), str(tmp_path / "o.csv"), "--n-expert", "8"
    )
    assert code == 2
    one_line_error(err, "o.csv: a route trace names the model's block", "give --block-map LIST")
    assert list(tmp_path.glob("o.*")) == list(tmp_path.glob("s.*")) == []


def test_info_with_block_map(capsys, tmp_path, model_path):
    """`trace info` can say which blocks a partial trace covers, like `convert`."""
    text = tmp_path / "peer.txt"
    text.write_text("0 0 1 2\n0 1 3 4\n1 0 5 6\n1 1 7 0\n")
    code, _, err = run_cli(capsys, "trace", "info", str(text), "--model", str(model_path))
    assert code == 2
    one_line_error(err, "3 MoE blocks (0-2) vs 2 trace layers", "give --block-map LIST")
    code, out, err = run_cli(
        capsys,
        *("trace", "info", str(text), "--model", str(model_path), "--block-map", "0,2"),
        "--json",
    )
    assert code == 0, err
    j = json.loads(out)
    assert j["block_map"] == [0, 2] and j["binding"]["blocks"] == [0, 2]
    assert [x["block"] for x in j["per_layer"]] == [0, 2]
    code, _, err = run_cli(
        capsys, "trace", "info", str(text), "--model", str(model_path), "--block-map", "0,7"
    )
    assert code == 2
    one_line_error(err, "block 7, which is not a MoE block")
    code, out, _ = run_cli(
        capsys, "trace", "info", str(text), "--n-expert", "8", "--block-map", "5-6"
    )
    assert code == 0 and "5-6" in out


def _no_nan(text: str) -> None:
    raise AssertionError(f"{text} in JSON output")


@pytest.mark.parametrize("prefill", [0, 6])
def test_info_and_convert_when_a_phase_is_empty(capsys, tmp_path, prefill):
    """No prefill (or only prefill): info says which phase is missing and why overlaps are
    not shown; JSON holds null, never NaN; every format converts it and keeps the split."""
    src = tmp_path / "t.moetrace"
    code, _, err = run_cli(
        capsys,
        *("trace", "synth", str(src), "--layers", "2", "--experts", "8", "--top-k", "2"),
        *("--tokens", "6", "--prefill", str(prefill), "--block-map", "0,1", "-q"),
    )
    assert code == 0, err
    empty, kept = ("prefill", "decode") if prefill == 0 else ("decode", "prefill")
    code, out, err = run_cli(capsys, "trace", "info", str(src))
    assert code == 0 and err == ""
    assert f"note: the trace has no {empty} tokens: per-phase statistics cover {kept} only" in out
    assert "note: overlap at lag 8 needs at least 9 tokens and the trace has 6" in out
    code, out, _ = run_cli(capsys, "trace", "info", str(src), "--json")
    j = json.loads(out, parse_constant=_no_nan)
    assert set(j["phases"]) == {kept} and len(j["notes"]) == 2
    assert all(x["overlap_lag"] is None for x in j["per_layer"])
    for name in ("a.pmxtrace", "a.txt", "a.csv", "b.moetrace"):
        code, _, err = run_cli(capsys, "trace", "convert", str(src), str(tmp_path / name), "-q")
        assert code == 0, err
        back = load_trace(tmp_path / name, n_expert=8)
        assert back.prefill_tokens == prefill and back.tokens == 6


def test_synth_bad_arguments(capsys, tmp_path, model_path):
    code, _, err = run_cli(capsys, "trace", "synth", str(tmp_path / "a.moetrace"), "--layers", "2")
    assert code == 2
    one_line_error(err, "give a model, or layers, n_expert and top_k")
    code, _, err = run_cli(
        capsys,
        "trace",
        "synth",
        str(tmp_path / "a.moetrace"),
        "--model",
        str(model_path),
        "--top-k",
        "3",
    )
    assert code == 2
    one_line_error(err, "top_k=3, but the model has 2")
    assert list(tmp_path.glob("a.*")) == []


def test_console_script_exit_code(tmp_path):
    """The installed ``moepack`` command: exit 2 and one line on stderr."""
    p = tmp_path / "x.txt"
    p.write_text("0 0 1 2\n")
    exe = Path(sys.executable).with_name("moepack")
    r = subprocess.run([str(exe), "trace", "info", str(p)], capture_output=True, text=True)
    assert r.returncode == 2
    one_line_error(r.stderr, "does not say how many experts")
    assert r.stdout == ""


def test_the_version_said_is_the_version_written(tmp_path, capsys):
    """``trace synth`` printed "moetrace v2" for a file whose version field is 1."""

    from moepack.trace import save_trace, synth_trace

    out = tmp_path / "s.moetrace"
    code, text, err = run_cli(capsys, "trace", "synth", out, "--layers", 2, "--experts", 8,
                              "--top-k", 2, "--tokens", 64)  # fmt: skip
    (field,) = struct.unpack_from("<I", out.read_bytes(), 8)
    assert code == 0 and field == 1, err
    assert f"moetrace v{field}," in text
    trace = synth_trace(tokens=40, layers=2, n_expert=8, top_k=2, seed=1)
    two = trace.replace(prefill_tokens=0, segments=[(0, 5, 15), (20, 5, 15)])
    for t, want in ((trace, 1), (two, 2)):
        saved = save_trace(t, tmp_path / f"v{want}.moetrace")
        assert saved.version == want
        assert struct.unpack_from("<I", saved.path.read_bytes(), 8) == (want,)
