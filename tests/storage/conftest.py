"""Fixtures for the storage tests: small real files, and real mounts of filesystems that lack
a mode (ramfs: no O_DIRECT, no DONTCACHE; tmpfs: no DONTCACHE) or are read-only."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    """A random file of an odd size (not a multiple of any block) on the test disk."""
    data = os.urandom(3 * (1 << 20) + 12345)
    p = tmp_path / "data.bin"
    p.write_bytes(data)
    return p, data


def _mount(kind: str, target: Path, options: str) -> None:
    args = ["mount", "-t", kind] + (["-o", options] if options else []) + [kind, str(target)]
    try:
        r = subprocess.run(args, capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no mount command here")
    if r.returncode != 0:
        pytest.skip(f"cannot mount {kind} here (needs root): {r.stderr.strip()}")


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[object]:
    """``mounted(kind, options)`` -> a fresh mount point, unmounted after the test."""
    points: list[Path] = []

    def make(kind: str, options: str = "") -> Path:
        target = tmp_path / f"mnt-{kind}-{len(points)}"
        target.mkdir()
        _mount(kind, target, options)
        points.append(target)
        return target

    yield make
    for p in reversed(points):
        subprocess.run(["umount", "-l", str(p)], capture_output=True)


def _run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "moepack.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def run_cli():
    """``run_cli(*args)``: run ``moepack`` as a user would, in its own process."""
    return _run_cli


@pytest.fixture
def run_main(capsys: pytest.CaptureFixture[str]):
    """``run_main(*args)``: the CLI's ``main`` in this process (fast), as a CompletedProcess."""
    from moepack.cli.main import main

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        try:
            main(list(args))
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["moepack", *args], code, out, err)

    return run
