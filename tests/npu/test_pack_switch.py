"""``npu pack --force`` killed (SIGKILL, a real subprocess) at each of its riskiest steps, by
the ``MOEPACK_KILL_AT`` hook: the pack folder is the old pack or the new one at every step,
a reader (``npu unpack``, a new process) reads one of the two whole, and the next run leaves
the new pack and no temporary. Both switches: the exchange of names, and the two renames
under a journal that replace it where the filesystem refuses the exchange."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import TINY_LAYER, TINY_PROFILE, write_layer_model

EXCHANGE_STEPS = ["folder-staged", "folder-exchanged", "folder-removing"]
FALLBACK_STEPS = ["folder-staged", "folder-journal", "switch-aside", "switch-placed"]
NOTES = "a file the user keeps in the pack folder"


def moepack(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "moepack", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | (env or {}),
        stdin=subprocess.DEVNULL,
    )


def snapshot(folder: Path) -> dict[str, str] | None:
    """sha256 of every file of the pack folder, None when there is no folder."""
    if not folder.is_dir():
        return None
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def temporaries(*folders: Path) -> list[str]:
    return [p.name for f in folders if f.is_dir() for p in f.iterdir() if ".moepack-" in p.name]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Two tiny models (old, new), their packs and what ``npu unpack`` rebuilds of each."""
    from moepack.npu.geometry import Geometry
    from moepack.npu.profiles import get_profile

    d = tmp_path_factory.mktemp("switch")
    geo = Geometry.scaled(1)
    roles = get_profile(TINY_PROFILE).layout(geo, geo.kind(TINY_LAYER)).roles()
    models = {k: write_layer_model(d / f"{k}.q4nx", geo, TINY_LAYER, roles, seed=s)
              for k, s in (("old", 1), ("new", 2))}  # fmt: skip
    states, unpacked = {}, {}
    for k, model in models.items():
        pack = d / f"pack-{k}"
        assert moepack("npu", "pack", model, "--out", pack, "--profile", TINY_PROFILE, "-q")
        (pack / "notes.txt").write_text(NOTES)
        states[k] = snapshot(pack)
        r = moepack("npu", "unpack", pack, "--out", d / f"{k}.unpacked.q4nx", "-q")
        assert r.returncode == 0, r.stderr
        unpacked[k] = (d / f"{k}.unpacked.q4nx").read_bytes()
    assert states["old"] != states["new"] and unpacked["old"] != unpacked["new"]
    return {"dir": d, "models": models, "states": states, "unpacked": unpacked}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("scheme", "step"),
    [("exchange", s) for s in EXCHANGE_STEPS] + [("renames", s) for s in FALLBACK_STEPS],
)
def test_a_kill_at_each_step_leaves_old_or_new_and_the_next_run_cleans_up(
    world: dict, tmp_path: Path, scheme: str, step: str
) -> None:
    states, unpacked = world["states"], world["unpacked"]
    home = tmp_path / "home"
    home.mkdir()
    out = home / "pack"
    shutil.copytree(world["dir"] / "pack-old", out)
    notes = (out / "notes.txt").stat().st_ino
    env = {"MOEPACK_KILL_AT": step}
    if scheme == "renames":
        env["MOEPACK_NO_RENAME_EXCHANGE"] = "1"
    new_model = world["models"]["new"]
    pack = ["npu", "pack", new_model, "--out", out, "--profile", TINY_PROFILE, "--force", "-q"]

    killed = moepack(*pack, env=env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr  # the hook's step was reached
    state = snapshot(out)
    if step == "switch-aside":  # between the two renames: no folder, a journal to finish
        assert state is None
    else:
        assert state in (states["old"], states["new"])  # never a mix

    # a reader, a new process: finishes what the journal says (or reads what is there whole)
    read = moepack("npu", "unpack", out, "--out", tmp_path / "read.q4nx")
    assert read.returncode == 0, read.stderr
    got = (tmp_path / "read.q4nx").read_bytes()
    seen = "new" if got == unpacked["new"] else "old" if got == unpacked["old"] else "mix"
    assert seen == ("new" if state is None or state == states["new"] else "old")
    warned = [ln for ln in read.stderr.splitlines() if ln.strip()]
    assert all(ln.startswith("moepack: warning: ") for ln in warned) and len(warned) <= 1
    assert snapshot(out) in (states["old"], states["new"])
    assert (out / "notes.txt").read_text() == NOTES and (out / "notes.txt").stat().st_ino == notes

    # the next run into the folder: the new pack, and nothing of the killed run left
    again = moepack(*pack)
    assert again.returncode == 0, again.stderr
    assert snapshot(out) == states["new"]
    assert temporaries(home, out) == []
    assert (out / "notes.txt").stat().st_ino == notes  # the same file all along


def test_the_exchange_swaps_two_folders_in_one_step(tmp_path: Path) -> None:
    from moepack import swap

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    (b / "y").write_text("b")
    ino_a, ino_b = a.stat().st_ino, b.stat().st_ino
    try:
        swap.exchange(a, b)
    except swap.ExchangeUnsupported:
        pytest.skip("this filesystem refuses RENAME_EXCHANGE (the journalled renames run)")
    assert (a / "y").read_text() == "b" and (b / "x").read_text() == "a"
    assert (a.stat().st_ino, b.stat().st_ino) == (ino_b, ino_a)
    with pytest.raises(OSError):
        swap.exchange(a, tmp_path / "missing")  # both names must exist
    assert (a / "y").exists()


def test_a_reader_that_may_not_write_refuses_a_half_switched_pack(
    world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed between the two renames (no folder, a journal in its parent): a reader that
    may not write there refuses in one line; one that may finishes the switch."""
    from moepack import safeio
    from moepack.errors import BadInput
    from moepack.npu.unpack import unpack

    out = tmp_path / "pack"
    shutil.copytree(world["dir"] / "pack-old", out)
    pack = ["npu", "pack", world["models"]["new"], "--out", out, "--profile", TINY_PROFILE]
    env = {"MOEPACK_KILL_AT": "switch-aside", "MOEPACK_NO_RENAME_EXCHANGE": "1"}
    assert moepack(*pack, "--force", "-q", env=env).returncode == -signal.SIGKILL
    assert not out.exists()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == tmp_path
                        else real_access(p, mode, **kw))  # fmt: skip
    with pytest.raises(BadInput, match="left a commit half done here") as e:
        unpack(out, tmp_path / "r.q4nx")
    assert "\n" not in str(e.value) and not out.exists()
    monkeypatch.setattr(os, "access", real_access)
    said: list[str] = []
    monkeypatch.setattr(safeio, "_notice", said.append)
    unpack(out, tmp_path / "r.q4nx")
    assert (tmp_path / "r.q4nx").read_bytes() == world["unpacked"]["new"]
    assert len(said) == 1 and "finished an interrupted commit (put in place: pack)" in said[0]


def test_a_failed_second_rename_puts_the_old_pack_back(
    world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback's new folder cannot be renamed in (after the old one went aside): the old
    one is put back, the journal removed, and the error is one line."""
    from moepack.errors import MoepackError
    from moepack.npu.packer import pack_model

    out = tmp_path / "pack"
    shutil.copytree(world["dir"] / "pack-old", out)
    monkeypatch.setenv("MOEPACK_NO_RENAME_EXCHANGE", "1")
    real_rename = os.rename
    failed: list[str] = []

    def rename(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if Path(str(dst)) == out and not out.exists() and not failed:  # the new one, going in
            failed.append(str(src))
            raise OSError(5, "Input/output error")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(MoepackError, match="input/output error"):
        pack_model(world["models"]["new"], out, TINY_PROFILE, force=True)
    assert failed and snapshot(out) == world["states"]["old"]
    assert temporaries(tmp_path, out) == []  # the new one, the journal: gone


def test_the_current_folder_is_refused(world: dict, tmp_path: Path, monkeypatch) -> None:
    from moepack.errors import BadInput
    from moepack.npu.packer import pack_model

    out = tmp_path / "pack"
    shutil.copytree(world["dir"] / "pack-old", out)
    monkeypatch.chdir(out)
    with pytest.raises(BadInput, match="holds the current folder"):
        pack_model(world["models"]["new"], ".", TINY_PROFILE, force=True)
    assert snapshot(out) == world["states"]["old"]
