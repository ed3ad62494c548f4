"""Command-line input the NPU commands must refuse in one line, and the words they use."""

from __future__ import annotations

import pytest

from .conftest import LINEAR


def _refused_option(r, option: str) -> None:
    """Exit 2, no traceback, and the message names the option (click's BadParameter; the
    entry point prints it as one line)."""
    assert r.code == 2, (r.out, r.err)
    assert "Traceback" not in r.err and r.out == ""
    assert option in r.err, r.err


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
