"""What ``pack`` may touch in its output folder: never a file it did not write, never an
existing file without ``--force``; with ``--force`` the folder is replaced whole by the new
pack, the files it did not write carried over (the same files), a subfolder refused."""

from __future__ import annotations

import json
import os

from moepack.npu.packer import pack_model

from .conftest import TINY_LAYER, TINY_PROFILE


def _manifest_listing(folder, names):
    doc = {"format": "moepack.npu.pack", "version": 1,
           "layers": [{"layer": 0, "buffers": [{"file": n} for n in names]}]}  # fmt: skip
    (folder / "manifest.json").write_text(json.dumps(doc))


def test_force_replaces_only_the_packers_own_files(tiny_model, tmp_path):
    out = tmp_path / "pack"
    out.mkdir()
    outside = tmp_path / "victim.txt"
    absolute = tmp_path / "absolute.txt"
    linked = tmp_path / "linked-target.bin"
    for p in (outside, absolute, linked):
        p.write_text("keep me")
    (out / "notes.txt").write_text("keep me too")
    (out / "notes-link.txt").symlink_to(outside)
    (out / "layer-09.weights.bin").write_bytes(b"stale")  # the packer's own kind of file
    (out / "layer-08.weights.bin").symlink_to(linked)  # its kind of name, pointing out
    _manifest_listing(out, ["../victim.txt", str(absolute), "notes.txt", "sub/../../victim.txt",
                            "layer-09.weights.bin", "layer-08.weights.bin",
                            "layer-06.weights.bin/../../victim.txt", None, 5])  # fmt: skip
    notes = (out / "notes.txt").stat()
    res = pack_model(tiny_model, out, TINY_PROFILE, force=True)
    assert outside.read_text() == absolute.read_text() == linked.read_text() == "keep me"
    kept = (out / "notes.txt").stat()
    assert (kept.st_ino, kept.st_dev) == (notes.st_ino, notes.st_dev)  # the same file
    assert (out / "notes-link.txt").readlink() == outside
    assert not os.path.lexists(out / "layer-09.weights.bin")  # the old pack's: gone
    assert not os.path.lexists(out / "layer-08.weights.bin")  # the name only
    written = {b.file for b in res.buffers}
    assert written == {f"layer-{TINY_LAYER:02d}.weights.bin", f"layer-{TINY_LAYER:02d}.router.bin"}
    assert sorted(os.listdir(out)) == sorted(
        [*written, "manifest.json", "notes.txt", "notes-link.txt"]
    )
    assert json.loads((out / "manifest.json").read_text())["format"] == "moepack.npu.pack"
    assert not [p for p in tmp_path.iterdir() if ".moepack-" in p.name]


def test_a_subfolder_is_refused_before_any_work(cli, tiny_model, tmp_path):
    out = tmp_path / "pack"
    (out / "layer-07.weights.bin").mkdir(parents=True)  # its kind of name, but a folder
    before = sorted(os.listdir(tmp_path))
    r = cli("npu", "pack", tiny_model, "--out", out, "--profile", TINY_PROFILE, "--force", "-q")
    assert r.code == 2 and "holds a folder ('layer-07.weights.bin')" in r.one_line_error()
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(out) == ["layer-07.weights.bin"]


def test_pack_never_overwrites_without_force(cli, tiny_model, tmp_path):
    out = tmp_path / "pack"
    out.mkdir()
    mine = out / f"layer-{TINY_LAYER:02d}.weights.bin"
    mine.write_bytes(b"not a pack")
    r = cli("npu", "pack", tiny_model, "--out", out, "--profile", TINY_PROFILE, "-q")
    line = r.one_line_error()
    assert r.code == 2 and f"would overwrite 1 existing file(s) ({mine.name})" in line
    assert mine.read_bytes() == b"not a pack" and os.listdir(out) == [mine.name]
    dangling = out / f"layer-{TINY_LAYER:02d}.router.bin"
    dangling.symlink_to(tmp_path / "nowhere")  # a dangling link is an existing name too
    r = cli("npu", "pack", tiny_model, "--out", out, "--profile", TINY_PROFILE, "-q")
    assert r.code == 2 and "would overwrite 2 existing file(s)" in r.one_line_error()
    dangling.unlink()
    r = cli("npu", "pack", tiny_model, "--out", out, "--profile", TINY_PROFILE, "--force", "-q")
    assert r.code == 0, r.err
    assert mine.stat().st_size > 1000 and (out / "manifest.json").exists()


def test_a_killed_force_pack_is_finished_by_the_next_run_which_says_so(
    cli, tiny_model, tmp_path, monkeypatch
):
    """Where the filesystem refuses the exchange, a pack switches by two renames under a
    journal. Killed after them, before its journal was removed: the next run says, in one
    warning line, that it finished the commit."""
    import subprocess
    import sys

    out = tmp_path / "pack"
    args = ["npu", "pack", str(tiny_model), "--out", str(out), "--profile", TINY_PROFILE, "-q"]
    assert cli(*args).code == 0
    env = os.environ | {"MOEPACK_NO_RENAME_EXCHANGE": "1", "MOEPACK_KILL_AT": "switch-placed"}
    r = subprocess.run([sys.executable, "-m", "moepack", *args, "--force"], env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == -9, r.stderr
    journals = [p.name for p in tmp_path.iterdir() if p.name.endswith(".moepack-journal")]
    assert len(journals) == 1
    from moepack import safeio

    monkeypatch.setattr(safeio, "_swept", set())  # the next run is a new process
    r2 = cli(*args, "--force")
    lines = [ln for ln in r2.err.splitlines() if ln.strip()]
    assert r2.code == 0 and len(lines) == 1, r2.err
    assert (
        lines[0].startswith("moepack: warning: ") and "finished an interrupted commit" in lines[0]
    )
    assert journals[0] in lines[0]
    assert not [p for p in tmp_path.iterdir() if ".moepack-" in p.name]
