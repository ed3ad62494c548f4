"""Prompt files (``trace capture`` / ``run`` ``--prompt-file``) and ``check-dropin --text`` are
read like every other input: regular files only, a size cap that says its number, bounded JSON
lines. Each case is refused before llama.cpp is started, so these tests do not need it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moefixtures import run_cli
from moepack.llama.runtime.prompts import MAX_PROMPT_FILE, read_prompt_file


def hostile(kind: str, folder: Path) -> Path:
    p = folder / "prompts.jsonl"
    if kind == "big-int":
        p.write_text('{"prompt": "hi"}\n{"prompt": "x", "n": ' + "7" * 5000 + "}\n")
    elif kind == "deep":
        p.write_text('{"prompt": "x", "n": ' + "[" * 3000 + "]" * 3000 + "}\n")
    elif kind == "dev-zero":
        p.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "too-big":
        with open(p, "wb") as fh:  # sparse: the size is checked before anything is read
            fh.truncate(MAX_PROMPT_FILE + 1)
    elif kind == "bad-json":
        p.write_text('{"prompt": "a"}\n{"prompt": \n')
    return p


CASES = [
    ("big-int", "line 2 is not valid JSON: integer 777777777777777777777777"),
    ("deep", "line 1 is nested too deeply (3,001 levels; at most 64 are allowed)"),
    ("dev-zero", "is a character device, not a prompt file (moepack reads regular files only)"),
    ("fifo", "is a FIFO (named pipe), not a prompt file"),
    ("too-big", "67,108,865 bytes is more than a prompt file may hold (67,108,864 bytes)"),
    ("bad-json", "line 2 is not valid JSON, corrupt at column 12: Expecting value"),
]


@pytest.mark.parametrize(("kind", "message"), CASES, ids=[c[0] for c in CASES])
def test_prompt_file_reader(kind, message, tmp_path):
    from moepack.errors import BadInput

    with pytest.raises(BadInput) as e:
        read_prompt_file(hostile(kind, tmp_path))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("command", ["capture", "run"])
@pytest.mark.parametrize(("kind", "message"), CASES[:4], ids=[c[0] for c in CASES[:4]])
def test_capture_and_run_refuse_hostile_prompt_files_in_one_line(
    capsys, tmp_path, command, kind, message
):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    pf = hostile(kind, tmp_path)
    out = tmp_path / "t.moetrace"
    args = (
        ["trace", "capture", model, "--out", out]
        if command == "capture"
        else ["run", model, "--trace", out]
    )
    code, _out, err = run_cli(capsys, *args, "--prompt-file", pf)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("moepack: error: "), err
    assert message in lines[0] and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_check_dropin_text_is_a_regular_file(capsys, tmp_path, kind):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    text = hostile(kind, tmp_path)
    code, _out, err = run_cli(capsys, "check-dropin", model, model, "--text", text)
    assert code == 2 and "not a text file (moepack reads regular files only)" in err, err
    assert len(err.strip().splitlines()) == 1
