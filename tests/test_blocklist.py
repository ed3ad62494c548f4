"""One parser and one formatter for block and layer lists, capped before it allocates."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from moefixtures import run_cli
from moepack.blocklist import MAX_INDEX, format_index_list, parse_index_list
from moepack.errors import BadInput


def test_parses_in_order_or_as_a_sorted_set():
    assert parse_index_list("5,0-3") == [5, 0, 1, 2, 3]
    assert parse_index_list("5, 0-3, 2", unique=True) == [0, 1, 2, 3, 5]
    assert parse_index_list(" 4 - 6 ") == [4, 5, 6]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "names no blocks"),
        (" , ,", "names no blocks"),
        ("x", r"'x' is not N or N-M"),
        ("-1", r"'-1' is not N or N-M"),
        ("1-", r"'1-' is not N or N-M"),
        ("3-1", "'3-1' is reversed"),
        ("1,,x", r"'x' is not N or N-M"),
    ],
)
def test_bad_lists_say_which_part(text: str, message: str):
    with pytest.raises(BadInput, match=message):
        parse_index_list(text)


@pytest.mark.parametrize(
    "text", ["0-99999999999999", "0-30000000", "9" * 40, "0-" + "9" * 5000, "4096"]
)
def test_past_the_limit_is_refused_before_anything_is_built(text: str):
    tracemalloc.start()
    try:
        with pytest.raises(BadInput, match=r"out of range \(at most 4,096 blocks: 0-4095\)"):
            parse_index_list(text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024  # the text and a message, not a list of millions


def test_the_length_is_capped_too():
    with pytest.raises(BadInput, match="names 8,192 blocks; at most 4,096 are allowed"):
        parse_index_list("0-4095,0-4095")
    assert len(parse_index_list(f"0-{MAX_INDEX - 1}")) == MAX_INDEX
    with pytest.raises(BadInput, match=r"layer 40 is out of range \(at most 40 layers"):
        parse_index_list("0-40", "layer", limit=40)


def test_formatter_joins_runs_and_round_trips():
    assert format_index_list([8, 7, 0, 1, 2, 3, 5]) == "0-3,5,7-8"
    assert format_index_list([0, 1, 2, 3, 5, 7, 8], ", ") == "0-3, 5, 7-8"
    assert format_index_list([]) == "none"
    numbers = [0, 2, 3, 4, 9, 11, 12]
    assert parse_index_list(format_index_list(numbers)) == numbers


@pytest.fixture
def small_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    path = tmp_path / "t.moetrace"
    code, _, err = run_cli(
        capsys,
        "trace",
        "synth",
        path,
        "--layers",
        2,
        "--experts",
        8,
        "--top-k",
        2,
        "--tokens",
        32,
        "-q",
    )
    assert code == 0, err
    return path


@pytest.mark.parametrize("value", ["0-99999999999999", "0-30000000"])
def test_block_map_option_names_itself_and_the_limit(
    small_trace: Path, value: str, capsys: pytest.CaptureFixture[str]
):
    tracemalloc.start()
    try:
        code, out, err = run_cli(capsys, "trace", "info", small_trace, "--block-map", value)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert code == 2 and out == ""
    assert err.count("\n") == 1, err
    assert "'--block-map'" in err and "at most 4,096 blocks: 0-4095" in err
    assert peak < 16 * 2**20  # refused before building the list (0-30000000 cost 1.46 GB)


def test_npu_layers_option_is_capped(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "m.q4nx"
    code, _, err = run_cli(capsys, "npu", "synth", out, "--layers", "0-99999999999")
    assert code == 2 and not out.exists()
    assert "'--layers'" in err and "at most 4,096 layers" in err and err.count("\n") == 1
