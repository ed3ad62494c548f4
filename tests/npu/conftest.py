"""Shared fixtures: one small synthetic model (scaled geometry, layers 2 and 3: one linear,
one full-attention layer, ~100 MB), generated once per session; a tiny one (~2 MB) for tests
that pack hundreds of times; and a CLI runner."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moepack.cli.main import main
from moepack.npu.geometry import Geometry
from moepack.npu.profiles import get_profile
from moepack.npu.q4nx import TensorSpec, layout, write_q4nx
from moepack.npu.synth import produce, synth

LINEAR, FULL = 2, 3
TINY_PROFILE, TINY_LAYER = "seed-2026-09", 3


def write_layer_model(path: Path, geo: Geometry, layer: int, roles, seed: int = 1) -> Path:
    """A .q4nx holding only ``roles`` of one layer, with synth's codec-valid bytes."""
    specs = [TensorSpec(geo.name_of(r, layer), geo.shape(r).dtype, geo.shape(r).shape)
             for r in roles]  # fmt: skip
    with open(path, "wb") as fh:
        write_q4nx(fh, specs, lambda s: produce(s, seed), {"moepack.geometry": geo.name})
    return path


@pytest.fixture(scope="session")
def model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("npu") / "scaled.q4nx"
    synth(path, "scaled", f"{LINEAR},{FULL}", seed=7)
    return path


def sparse_model(path: Path, specs, metadata=None) -> Path:
    """A .q4nx whose tensors are all zero bytes (a sparse file): for header-level tests."""
    header, placed = layout(specs, metadata)
    with open(path, "wb") as fh:
        fh.write(header)
        fh.truncate(len(header) + sum(s.nbytes for s, _ in placed))
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """Layer 3 (full attention) of a 1-expert geometry holding only what seed-2026-09 places
    there: three expert tensors and the router tensors, ~2 MB."""
    geo = Geometry.scaled(1)
    roles = get_profile(TINY_PROFILE).layout(geo, geo.kind(TINY_LAYER)).roles()
    path = tmp_path_factory.mktemp("tiny") / "tiny.q4nx"
    return write_layer_model(path, geo, TINY_LAYER, roles)


@pytest.fixture(scope="session")
def tiny_pack(tiny_model, tmp_path_factory) -> Path:
    from moepack.npu.packer import pack_model

    out = tmp_path_factory.mktemp("tinypack") / "pack"
    pack_model(tiny_model, out, TINY_PROFILE)
    return out


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
