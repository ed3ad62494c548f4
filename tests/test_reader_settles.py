"""A reader of a group of outputs that meets a commit a killed run left half done finishes it
(where it may write) or refuses in one line; it never reads the mix. The group: a split
model's shards, written by ``synth --force`` over an older one and killed (SIGKILL, by the
``MOEPACK_KILL_AT`` hook) after its journal was written, or after the first of its renames."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from moepack import safeio
from moepack.checkpoint import MoeModel
from moepack.errors import BadInput


def moepack(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "moepack", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | (env or {}),
        stdin=subprocess.DEVNULL,
    )


def shards(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.glob("m-*-of-*.gguf"))
    }


SYNTH = ["synth", "--layers", "4", "--split-max-size", "60000", "-q"]


@pytest.fixture(scope="module")
def states(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    out = {}
    for seed in (1, 2):
        d = tmp_path_factory.mktemp(f"seed{seed}")
        assert moepack(*SYNTH, "--out", d / "m.gguf", "--seed", seed).returncode == 0
        out[f"seed{seed}"] = shards(d)
    assert len(out["seed1"]) >= 3 and out["seed1"].keys() == out["seed2"].keys()
    return out


def killed_mid_commit(folder: Path, step: str) -> None:
    """An old model (seed 1) in ``folder``, and ``synth --force`` of a new one (seed 2) killed
    at ``step`` of its commit."""
    assert moepack(*SYNTH, "--out", folder / "m.gguf", "--seed", 1).returncode == 0
    r = moepack(*SYNTH, "--out", folder / "m.gguf", "--seed", 2, "--force",
                env={"MOEPACK_KILL_AT": step})  # fmt: skip
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert [p for p in folder.iterdir() if p.name.endswith(".moepack-journal")]


@pytest.mark.parametrize("step", ["commit-journal", "commit-renamed-first"])
def test_a_reader_finishes_the_commit_and_reads_the_new_model(
    states: dict[str, dict[str, str]], tmp_path: Path, step: str
) -> None:
    killed_mid_commit(tmp_path, step)
    if step == "commit-renamed-first":
        left = shards(tmp_path)
        mixed = {n for n, h in left.items() if h == states["seed2"][n]}
        assert 0 < len(mixed) < len(left)  # the mix a reader used to read
    first = sorted(tmp_path.glob("m-*-of-*.gguf"))[0]
    r = moepack("inspect", first, "--json")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 0 and len(lines) == 1, r.stderr
    assert (
        lines[0].startswith("moepack: warning: ") and "finished an interrupted commit" in lines[0]
    )
    assert shards(tmp_path) == states["seed2"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".moepack-journal")]


def test_a_reader_that_may_not_write_refuses_in_one_line(
    states: dict[str, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    killed_mid_commit(tmp_path, "commit-renamed-first")
    before = shards(tmp_path)
    first = sorted(tmp_path.glob("m-*-of-*.gguf"))[0]
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == tmp_path
                        else real_access(p, mode, **kw))  # fmt: skip
    with pytest.raises(BadInput, match="left a commit half done here") as e:
        MoeModel(first)
    assert str(e.value).startswith(f"{tmp_path}: ") and "\n" not in str(e.value)
    assert shards(tmp_path) == before  # nothing touched


def test_a_live_runs_journal_is_waited_for_then_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A journal whose owner still runs (this process) is a commit under way: a reader waits
    for it briefly, then refuses rather than read what may be a mix."""
    from moepack import leftovers

    model = tmp_path / "m.gguf"
    assert moepack("synth", "--out", model, "-q").returncode == 0
    journal = tmp_path / leftovers.temp_name("moepack-commit", leftovers.JOURNAL_SUFFIX)
    journal.write_bytes(b"{}")
    monkeypatch.setattr(safeio, "SETTLE_WAIT", 0.1)
    with pytest.raises(BadInput, match=f"pid {os.getpid()}.* is switching outputs"):
        MoeModel(model)
    journal.unlink()
    with MoeModel(model) as m:
        assert m.blocks
