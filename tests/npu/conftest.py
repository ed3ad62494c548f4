"""Shared fixtures: one small synthetic model (scaled geometry, layers 2 and 3: one linear,
one full-attention layer, ~100 MB), generated once per session, and a CLI runner."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moepack.cli.main import main
from moepack.npu.synth import synth

LINEAR, FULL = 2, 3


@pytest.fixture(scope="session")
def model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("npu") / "scaled.q4nx"
    synth(path, "scaled", f"{LINEAR},{FULL}", seed=7)
    return path


@pytest.fixture(scope="session")
def packed(model_path, tmp_path_factory):
    """Pack folders per profile, made on first use."""
    from moepack.npu.packer import pack_model

    made: dict[str, Path] = {}

    def get(profile: str) -> Path:
        if profile not in made:
            out = tmp_path_factory.mktemp("pack") / profile
            pack_model(model_path, out, profile)
            made[profile] = out
        return made[profile]

    return get


class CliResult:
    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err

    def one_line_error(self) -> str:
        """The error line, after asserting it is the only stderr output and no traceback."""
        lines = [x for x in self.err.splitlines() if x.strip()]
        assert "Traceback" not in self.err, self.err
        assert len(lines) == 1, self.err
        assert lines[0].startswith("moepack: error: "), self.err
        return lines[0]


@pytest.fixture
def cli(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")

    def run(*args: str | os.PathLike[str]) -> CliResult:
        capsys.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = int(e.code or 0)
        cap = capsys.readouterr()
        return CliResult(code, cap.out, cap.err)

    return run
