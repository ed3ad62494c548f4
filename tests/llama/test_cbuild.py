"""The prefetcher's C: real source files that compile without a warning, built once per source
and compiler into the cache directory and found there by the next process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moepack.llama.prefetcher import cbuild
from moepack.llama.prefetcher.evalgate import MAX_BASE_CHARS, MAX_BASES, MAX_SLOTS

CC = cbuild.compiler()
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler here")
GATE_LIMITS = {"MAX_BASES": MAX_BASES, "MAX_SLOTS": MAX_SLOTS, "MAX_BASE_CHARS": MAX_BASE_CHARS}
SOURCES = {"gate": (GATE_LIMITS, ()), "stream": ({}, ("-pthread",)), "pager": ({}, ("-pthread",))}


@needs_cc
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_each_source_compiles_with_no_warning(name: str, tmp_path: Path) -> None:
    assert CC is not None
    defines, flags = SOURCES[name]
    args = [*cbuild.build_flags(defines, flags), "-Werror"]
    proc = cbuild.compile_to(CC, cbuild.CSRC / f"{name}.c", args, tmp_path / "x.so")
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr
    assert (tmp_path / "x.so").stat().st_size > 0


def test_the_gate_refuses_to_build_without_its_limits(tmp_path: Path) -> None:
    if CC is None:
        pytest.skip("no C compiler here")
    proc = cbuild.compile_to(
        CC, cbuild.CSRC / "gate.c", cbuild.build_flags({}, ()), tmp_path / "x.so"
    )
    assert proc.returncode != 0 and "the limits come from evalgate.py" in proc.stderr


def _logging_compiler(tmp_path: Path) -> tuple[Path, Path]:
    """A ``CC`` that logs each call and hands it to the real compiler."""
    assert CC is not None
    log = tmp_path / "cc.log"
    wrapper = tmp_path / "cc-wrapper"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec {shutil.which(CC)} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, log


_LOAD_BOTH = (
    "from moepack.llama.prefetcher.evalgate import compile_gate\n"
    "from moepack.llama.prefetcher.native import native_library\n"
    "assert compile_gate() is not None and native_library() is not None\n"
)


def _load_in_a_new_process(env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-c", _LOAD_BOTH], env=env, check=True, timeout=300)


@needs_cc
def test_a_second_process_loads_what_the_first_built(tmp_path: Path) -> None:
    wrapper, log = _logging_compiler(tmp_path)
    env = {**os.environ, "CC": str(wrapper), "MOEPACK_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("MOEPACK_NO_C_GATE", None)
    _load_in_a_new_process(env)
    assert len(log.read_text().splitlines()) == 2  # the gate and the stream, built once each
    built = sorted(p.name for p in (tmp_path / "cache" / "c").iterdir())
    assert [n.split("-")[0] for n in built] == ["gate", "stream"]
    assert all(n.endswith(".so") for n in built)  # no temporary left beside them
    _load_in_a_new_process(env)
    assert len(log.read_text().splitlines()) == 2  # found built: no compiler run


@needs_cc
def test_an_unwritable_cache_still_builds_and_loads(tmp_path: Path) -> None:
    wrapper, log = _logging_compiler(tmp_path)
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    env = {**os.environ, "CC": str(wrapper), "MOEPACK_CACHE_DIR": str(blocked)}
    env.pop("MOEPACK_NO_C_GATE", None)
    _load_in_a_new_process(env)
    _load_in_a_new_process(env)
    assert len(log.read_text().splitlines()) == 4  # a temporary build each time, both loaded


@needs_cc
def test_a_new_source_flag_or_compiler_names_a_new_library(tmp_path: Path) -> None:
    assert CC is not None
    args = cbuild.build_flags(GATE_LIMITS, ())
    name = cbuild.library_name("gate", CC, args)
    assert name == cbuild.library_name("gate", CC, list(args))
    assert name != cbuild.library_name("gate", CC, cbuild.build_flags(GATE_LIMITS, ("-g",)))
    other = tmp_path / "cc"
    other.write_text("#!/bin/sh\n")
    assert name != cbuild.library_name("gate", str(other), args)
    assert name != cbuild.library_name("stream", CC, args)
