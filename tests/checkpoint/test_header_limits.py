"""Headers llama.cpp refuses are refused by every command that reads them, in one line: metadata
arrays nested past ``MAX_ARRAY_NESTING`` (gguf-py parses them by recursion) and an
``expert_used_count`` of 0 or above ``expert_count``."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from gguf import GGUFValueType

from moefixtures import craft_metadata, metadata_entries, run_cli, tiny_spec
from moepack.checkpoint.gguf_file import MAX_ARRAY_NESTING, GgufFile
from moepack.checkpoint.provenance import pack_kv
from moepack.checkpoint.synth import synth_model


def nested_array(key: str, depth: int) -> bytes:
    """One metadata entry: ``depth`` arrays, each holding the next (12 bytes a level), the
    innermost an empty array of u32."""
    value = struct.pack("<IQ", GGUFValueType.UINT32, 0)
    for _ in range(depth - 1):
        value = struct.pack("<IQ", GGUFValueType.ARRAY, 1) + value
    raw = key.encode()
    return struct.pack("<Q", len(raw)) + raw + struct.pack("<I", GGUFValueType.ARRAY) + value


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_model(tmp_path_factory.mktemp("m") / "m.gguf", tiny_spec()).paths[0]


def with_entries(model: Path, dst: Path, replace: dict[str, bytes], extra: bytes = b"") -> Path:
    kvs = [replace.get(k, raw) for k, raw in metadata_entries(model)]
    return craft_metadata(model, dst, [*kvs, extra] if extra else kvs)


def one_line_error(err: str, *needles: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("moepack: error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def commands(model: Path, bad: Path, out: Path) -> list[tuple[int, list[object]]]:
    """Readers of a model header and their exit codes: ``verify`` fails a candidate it cannot
    read (exit 1: it never says OK on a changed file), the others refuse the input (2)."""
    return [
        (2, ["inspect", bad]),
        (2, ["store", "build", bad, "--out", out / "s.moestore"]),
        (2, ["compare", model, bad]),
        (1, ["verify", model, bad]),
    ]


def test_nesting_up_to_the_bound_reads(model, tmp_path):
    path = with_entries(
        model, tmp_path / "ok.gguf", {}, nested_array("x.nested", MAX_ARRAY_NESTING)
    )
    assert GgufFile(path).get("x.nested") == []


@pytest.mark.parametrize("depth", [MAX_ARRAY_NESTING + 1, 500])
def test_deeper_nesting_is_one_line_everywhere(capsys, model, tmp_path, depth):
    bad = with_entries(model, tmp_path / "deep.gguf", {}, nested_array("x.nested", depth))
    for expected, args in commands(model, bad, tmp_path):
        code, _out, err = run_cli(capsys, *args)
        assert code == expected, (args, err)
        one_line_error(err, "deep.gguf", f"nest more than {MAX_ARRAY_NESTING} deep")
    assert not (tmp_path / "s.moestore").exists()


@pytest.mark.parametrize("used, why", [(9, "more than qwen3moe.expert_count 8"), (0, "is 0")])
def test_expert_used_count_out_of_range_is_refused(capsys, model, tmp_path, used, why):
    key = "qwen3moe.expert_used_count"
    bad = with_entries(
        model, tmp_path / "topk.gguf", {key: pack_kv(key, GGUFValueType.UINT32, used)}
    )
    for expected, args in commands(model, bad, tmp_path):
        code, _out, err = run_cli(capsys, *args)
        assert code == expected, (args, err)
        one_line_error(err, "topk.gguf", key, why)
    assert not (tmp_path / "s.moestore").exists()


def test_expert_used_count_equal_to_expert_count_reads(capsys, model, tmp_path):
    key = "qwen3moe.expert_used_count"
    ok = with_entries(model, tmp_path / "all.gguf", {key: pack_kv(key, GGUFValueType.UINT32, 8)})
    code, _out, err = run_cli(capsys, "inspect", ok)
    assert code == 0, err
