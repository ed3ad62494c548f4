"""Command-line input the NPU commands must refuse in one line, and the words they use."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import pytest

from moepack.errors import BadInput
from moepack.npu.manifest import read_manifest
from moepack.npu.txn import decode_file

from .conftest import LINEAR, TINY_PROFILE

ROOT = Path(__file__).resolve().parents[2]


def _refused_option(r, option: str) -> None:
    """Exit 2, nothing on stdout, one line naming the option (click's BadParameter)."""
    assert r.code == 2, (r.out, r.err)
    assert r.out == "" and f"'{option}'" in r.one_line_error()


VERIFY = ["verify", "--dump", "{tmp}/d", "--model", "{tmp}/m"]


@pytest.mark.parametrize(
    "args, option",
    [
        (["synth", "{tmp}/s.q4nx", "--seed", "-1"], "--seed"),
        (["map", "--layer", "-1"], "--layer"),
        (VERIFY + ["--layer", "-1"], "--layer"),
        (VERIFY + ["--layer", "3", "--mismatches", "-1"], "--mismatches"),
        (VERIFY + ["--layer", "3", "--locate", "-2"], "--locate"),
    ],
)
def test_negative_integer_options_are_refused(cli, tmp_path, args, option):
    r = cli("npu", *[a.format(tmp=tmp_path) for a in args])
    _refused_option(r, option)
    assert list(tmp_path.iterdir()) == []


def test_verify_with_no_mismatches_listed_still_says_it_differs(cli, model_path, packed, tmp_path):
    dump = packed("flm-1.0.x-pool") / f"layer-{LINEAR:02d}.weights.bin"
    bad = tmp_path / "bad.bin"
    data = bytearray(dump.read_bytes())
    data[4736 * 40 + 3] ^= 0x55
    bad.write_bytes(bytes(data))
    r = cli("npu", "verify", "--dump", bad, "--model", model_path, "--layer", LINEAR,
            "--profile", "flm-1.0.x", "--mismatches", "0")  # fmt: skip
    assert r.code == 1
    assert "byte-identical" not in r.out
    assert "1 of the" in r.out and "compared differ" in r.out
    assert "1 bytes differ" in r.one_line_error().replace(",", "")


def test_missing_inputs_are_worded_like_the_rest(cli, tiny_model, tmp_path):
    gone = tmp_path / "gone"
    for args in (
        ["verify", "--dump", gone, "--model", tiny_model, "--layer", "3"],
        ["verify", "--dump", tiny_model, "--model", gone, "--layer", "3"],
        ["txn", "decode", gone],
        ["map", "--model", gone],
        ["pack", gone, "--out", tmp_path / "pk"],
    ):
        r = cli("npu", *args)
        assert r.code == 2 and r.one_line_error() == f"moepack: error: {gone}: no such file"
    with pytest.raises(BadInput, match=": is a folder, not a file$"):
        decode_file(tmp_path)  # (the command line refuses a folder before this)
    r = cli("npu", "unpack", gone, "--out", tmp_path / "x.q4nx")
    assert r.one_line_error() == f"moepack: error: {gone}: pack folder does not exist"
    with pytest.raises(BadInput, match="not a folder .expected a pack folder"):
        read_manifest(tiny_model)


def test_pack_into_a_missing_parent_is_refused_in_one_line(cli, tiny_model, tmp_path):
    out = tmp_path / "a" / "b" / "pk"
    r = cli("npu", "pack", tiny_model, "--out", out, "--profile", TINY_PROFILE, "-q")
    line = r.one_line_error()
    assert r.code == 2
    assert line == f"moepack: error: {out}: output folder '{out.parent}' does not exist"
    assert not (tmp_path / "a").exists()
    r = cli("npu", "pack", tiny_model, "--out", tiny_model / "pk", "--profile", TINY_PROFILE)
    assert r.code == 2 and f"'{tiny_model}' is a file, not a folder" in r.one_line_error()


def test_every_npu_definition_is_used():
    """No dead code in moepack.npu: every function, method and class is referred to
    somewhere in src, tests or benchmarks besides its own definition."""
    files = [p for d in ("src", "tests", "benchmarks") for p in (ROOT / d).rglob("*.py")]
    words: Counter[str] = Counter()
    for p in files:
        words.update(re.findall(r"[A-Za-z_]\w*", p.read_text()))
    unused = []
    for p in sorted((ROOT / "src/moepack/npu").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and not node.name.startswith("__")
                and words[node.name] <= 1
            ):
                unused.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert unused == []
