"""A group of small outputs appears whole or not at all (plan + map, surface + heatmap)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moepack.errors import BadInput
from moepack.outputs import write_together


def test_all_files_of_a_group_appear(tmp_path: Path):
    a, b = tmp_path / "a.moeplan", tmp_path / "a.png"
    assert write_together([(a, b"plan"), (b, b"png")]) == [a, b]
    assert a.read_bytes() == b"plan" and b.read_bytes() == b"png"


def test_a_late_failure_leaves_no_file_of_the_group(tmp_path: Path):
    first = tmp_path / "plan.moeplan"
    (tmp_path / "f").write_bytes(b"not a folder")
    with pytest.raises(BadInput, match="output folder"):
        write_together([(first, b"plan"), (tmp_path / "f" / "map.png", b"png")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # no output, no temporary


def test_an_input_is_never_a_destination(tmp_path: Path):
    src = tmp_path / "in.json"
    src.write_bytes(b"{}")
    with pytest.raises(BadInput, match="overwrite the input"):
        write_together([(tmp_path / "ok.png", b"png"), (src, b"x")], inputs=[src])
    assert src.read_bytes() == b"{}" and not (tmp_path / "ok.png").exists()
    assert write_together([]) == []
