"""AtomicOutputs: a group commits as a whole, temporaries are owned from their first instant,
and what a killed run left is finished or removed by the next run into the folder — with real
signals, real kills and real files (the signal is sent at the exact instant under test)."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moefixtures import run_cli
from moepack import leftovers, safeio
from moepack.errors import BadInput, MoepackError
from moepack.safeio import AtomicOutputs, check_destination, replacing


def temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".moepack-" in p.name)


def own_start() -> int:
    stat = Path("/proc/self/stat").read_bytes()
    return int(stat[stat.rfind(b")") + 2 :].split()[19])


@pytest.fixture
def notices(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    said: list[str] = []
    monkeypatch.setattr(safeio, "_notice", said.append)
    monkeypatch.setattr(safeio, "_swept", set())
    return said


def write_group(folder: Path, names: list[str], text: str) -> None:
    with AtomicOutputs() as out:
        for name in names:
            out.open(folder / name).write(text.encode())


def test_a_temporary_names_its_process_and_start_time(tmp_path: Path) -> None:
    with AtomicOutputs() as out:
        out.open(tmp_path / "x.bin").write(b"x")
        (name,) = temps(tmp_path)
    m = re.fullmatch(r"\.x\.bin\.(\d+)-(\d+)-[0-9a-f]+\.moepack-tmp", name)
    assert m and int(m[1]) == os.getpid() and int(m[2]) == own_start(), name
    assert temps(tmp_path) == [] and (tmp_path / "x.bin").read_bytes() == b"x"


def test_a_signal_right_after_creation_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C lands the instant the temporary exists, before ``open`` returns."""
    real_open = os.open
    fired: list[str] = []

    def open_then_ctrl_c(path: str | os.PathLike[str], flags: int, mode: int = 0o777) -> int:
        fd = real_open(path, flags, mode)
        if not fired and str(path).endswith(".moepack-tmp"):
            fired.append(str(path))
            signal.raise_signal(signal.SIGINT)
        return fd

    monkeypatch.setattr(os, "open", open_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt), AtomicOutputs() as out:
        out.open(tmp_path / "out.gguf").write(b"never")
    assert fired and temps(tmp_path) == [] and not (tmp_path / "out.gguf").exists()


def test_ctrl_c_between_the_renames_finishes_the_whole_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = ["a.bin", "b.bin", "manifest.json"]
    write_group(tmp_path, names, "old")
    real_replace = os.replace
    calls: list[str] = []

    def replace_then_ctrl_c(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        real_replace(src, dst)
        calls.append(str(dst))
        if Path(dst).name == "a.bin":  # the first output is in place, two are not
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(os, "replace", replace_then_ctrl_c)
    out = AtomicOutputs()
    with pytest.raises(KeyboardInterrupt), replacing(), out:  # the old group is replaced
        for name in names:
            out.open(tmp_path / name).write(b"new")
    assert out.committed
    assert [(tmp_path / n).read_bytes() for n in names] == [b"new"] * 3
    assert temps(tmp_path) == []
    assert set(safeio.written_outputs()) >= {tmp_path / n for n in names}


def test_discarding_keeps_what_would_have_been_removed(tmp_path: Path) -> None:
    (tmp_path / "stale.bin").write_bytes(b"old pack")
    with pytest.raises(RuntimeError), AtomicOutputs() as out:
        out.open(tmp_path / "new.bin").write(b"new")
        out.remove_on_commit(tmp_path / "stale.bin")
        raise RuntimeError("the packer failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stale.bin"]
    with AtomicOutputs() as out:
        out.open(tmp_path / "new.bin").write(b"new")
        out.remove_on_commit(tmp_path / "stale.bin")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.bin"]


def test_staged_paths_and_folders_for_writers_that_name_their_files(tmp_path: Path) -> None:
    other = tmp_path / "traces"
    other.mkdir()
    with AtomicOutputs() as out:
        staged = out.staged_path(tmp_path / "q.gguf")
        staged.write_bytes(b"quantised")  # as llama.cpp's quantiser would
        work = out.staged_dir(tmp_path)
        for i in (1, 2):
            (work / f"m-0000{i}-of-00002.gguf").write_bytes(b"shard %d" % i)
            out.adopt(work / f"m-0000{i}-of-00002.gguf", tmp_path / f"m-0000{i}-of-00002.gguf")
        (work / "t.txt").write_bytes(b"trace")
        out.adopt(work / "t.txt", other / "t.txt")  # lands in another folder
        assert not (tmp_path / "q.gguf").exists()
    assert (tmp_path / "q.gguf").read_bytes() == b"quantised"
    assert (tmp_path / "m-00002-of-00002.gguf").read_bytes() == b"shard 2"
    assert (other / "t.txt").read_bytes() == b"trace"
    assert temps(tmp_path) == [] and temps(other) == []


def test_a_writer_that_made_nothing_changes_nothing(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"old")
    with pytest.raises(MoepackError, match="did not create"), replacing(), AtomicOutputs() as out:
        out.open(tmp_path / "a.gguf").write(b"new")
        out.staged_path(tmp_path / "b.gguf")
    assert (tmp_path / "a.gguf").read_bytes() == b"old"
    assert temps(tmp_path) == [] and not (tmp_path / "b.gguf").exists()


KILL_MID_COMMIT = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from moepack.safeio import AtomicOutputs, replacing
    real = os.replace
    def replace_then_die(src, dst):
        real(src, dst)
        if Path(dst).name == sys.argv[3]:
            os.kill(os.getpid(), signal.SIGKILL)
    os.replace = replace_then_die
    with replacing(), AtomicOutputs() as out:
        for dest in sys.argv[1:3]:
            out.open(dest).write(b"new")
        out.open(sys.argv[4]).write(b"new")
    """
)


def test_a_kill_between_the_renames_is_finished_by_the_next_run(
    tmp_path: Path, notices: list[str]
) -> None:
    """Outputs in two folders; the process dies after the first is in place; the next run
    into each folder finishes that folder's part from its own copy of the journal."""
    models, traces = tmp_path / "models", tmp_path / "traces"
    models.mkdir()
    traces.mkdir()
    a, b, c = models / "a.gguf", models / "b.gguf", traces / "t.txt"
    for p in (a, b, c):
        p.write_bytes(b"old")
    proc = subprocess.run(
        [sys.executable, "-c", KILL_MID_COMMIT, str(a), str(b), "a.gguf", str(c)],
        capture_output=True,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert [p.read_bytes() for p in (a, b, c)] == [b"new", b"old", b"old"]  # mid-switch
    assert any(n.endswith(".moepack-journal") for n in temps(traces))
    with AtomicOutputs() as out:  # the next run into the traces folder
        out.open(traces / "other.txt").write(b"x")
    assert c.read_bytes() == b"new" and temps(traces) == []
    with AtomicOutputs() as out:  # and into the models folder
        out.open(models / "other.gguf").write(b"x")
    assert [p.read_bytes() for p in (a, b, c)] == [b"new"] * 3
    assert temps(models) == [] and temps(traces) == []
    assert len(notices) == 2 and all("finished an interrupted commit" in n for n in notices)
    assert "t.txt" in notices[0] and "b.gguf" in notices[1], notices


def test_a_journal_never_reaches_beyond_its_own_folder(tmp_path: Path) -> None:
    """A journal is a file in a folder anyone with write access there could have made."""
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    (elsewhere / "precious").write_bytes(b"keep")
    (elsewhere / "victim").write_bytes(b"keep")
    (here / "mine").write_bytes(b"old")
    forged = leftovers.Journal(
        renames=[(elsewhere / "precious", elsewhere / "victim"), (here / "mine", here / "x")],
        removes=[elsewhere / "precious"],
        cleanup=[elsewhere],
    )
    (here / ".moepack-commit.999999999-1-00ff.moepack-journal").write_bytes(forged.encode())
    done = leftovers.sweep(here)
    assert (elsewhere / "precious").read_bytes() == b"keep"
    assert (elsewhere / "victim").read_bytes() == b"keep"
    assert (here / "mine").read_bytes() == b"old"  # not a temporary: never renamed
    assert done.completed == [] and temps(here) == []


def test_a_journal_nested_past_the_recursion_limit_is_unreadable_not_a_crash(
    tmp_path: Path,
) -> None:
    name = ".moepack-commit.999999999-1-00ff.moepack-journal"
    (tmp_path / name).write_bytes(b"[" * 100_000)  # anyone who can write here could leave it
    done = leftovers.sweep(tmp_path)
    assert done.unreadable == [name] and temps(tmp_path) == []


def test_the_sweep_removes_only_what_dead_processes_left(
    tmp_path: Path, notices: list[str]
) -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(gone.stdout)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live_start = leftovers.process_start(live.pid)
        me = f"{os.getpid()}-{own_start()}"
        files = {
            f".m.gguf.{dead_pid}-1234-00aa.moepack-tmp": 4096,  # its process is gone
            f".m.gguf.{os.getpid()}-{own_start() + 1}-00bb.moepack-tmp": 10,  # pid reused
            f".m.gguf.{me}-00cc.moepack-tmp": 5,  # ours
            f".m.gguf.{live.pid}-{live_start}-00dd.moepack-tmp": 6,  # alive
            ".m.gguf.k2j3h4.moepack-tmp": 7,  # no owner in the name: not ours to judge
        }
        for name, size in files.items():
            (tmp_path / name).write_bytes(b"\0" * size)
        (tmp_path / f".moepack-staging.{dead_pid}-99-00ee.moepack-tmp").mkdir()
        (tmp_path / f".moepack-staging.{dead_pid}-99-00ee.moepack-tmp" / "x").write_bytes(b"1")
        done = leftovers.sweep(tmp_path)
    finally:
        live.kill()
        live.wait()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(
        [
            f".m.gguf.{me}-00cc.moepack-tmp",
            f".m.gguf.{live.pid}-{live_start}-00dd.moepack-tmp",
            ".m.gguf.k2j3h4.moepack-tmp",
        ]
    )
    assert sum(n for _name, n in done.removed) == 4096 + 10 + 1
    assert "removed 3 leftover(s) of killed runs, 4,107 bytes" in done.message()


def test_the_command_line_says_in_one_line_what_it_swept(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, notices: list[str]
) -> None:
    (tmp_path / "in").mkdir()
    trace = tmp_path / "in" / "t.pmxtrace"
    code, _out, err = run_cli(
        capsys,
        "trace",
        "synth",
        trace,
        "--layers",
        "2",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--tokens",
        "64",
        "-q",
    )
    assert code == 0, err
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    left = tmp_path / f".t.moetrace.{int(dead.stdout)}-77-0a0b.moepack-tmp"
    left.write_bytes(b"\0" * 1000)
    code, _out, err = run_cli(capsys, "trace", "convert", trace, tmp_path / "t.moetrace", "-q")
    assert code == 0, err
    warnings = [ln for ln in err.splitlines() if ln.strip()]
    assert len(warnings) == 1 and warnings[0].startswith("moepack: warning: "), err
    assert left.name in warnings[0] and "1,000 bytes" in warnings[0]
    assert not left.exists()


def test_a_journal_that_cannot_be_written_everywhere_leaves_none(tmp_path: Path) -> None:
    """The disk of the second folder is full when its journal copy is written: the copy
    already in the first folder must go too, or a later run would carry out the removal."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    big, small = tmp_path / "big", tmp_path / "small"
    big.mkdir()
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(small)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (big / "stale.bin").write_bytes(b"old")
        with pytest.raises(MoepackError, match="no space left"), AtomicOutputs() as out:
            out.open(big / "a.bin").write(b"new")
            out.open(small / "b.bin").write(b"\0" * 8192)  # fills the small disk exactly
            out.remove_on_commit(big / "stale.bin")
        assert sorted(p.name for p in big.iterdir()) == ["stale.bin"]
        assert list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_what_a_nested_group_wrote_into_staging_is_not_reported_as_written(
    tmp_path: Path,
) -> None:
    """synth writes its trace through save_trace (a group of its own) into the staging
    folder: an interrupt after that must not name the staging file as written."""
    with pytest.raises(KeyboardInterrupt), AtomicOutputs() as out:
        staging = out.staged_dir(tmp_path)
        with AtomicOutputs() as inner:
            inner.open(staging / "t.pmxtrace").write(b"trace")
        raise KeyboardInterrupt
    assert not any(p.is_relative_to(tmp_path) for p in safeio.written_outputs())
    with AtomicOutputs() as out:
        staging = out.staged_dir(tmp_path)
        with AtomicOutputs() as inner:
            inner.open(staging / "t.pmxtrace").write(b"trace")
        out.adopt(staging / "t.pmxtrace", tmp_path / "t.pmxtrace")
    mine = [p for p in safeio.written_outputs() if p.is_relative_to(tmp_path)]
    assert mine == [tmp_path / "t.pmxtrace"] and temps(tmp_path) == []


def dead_pid() -> int:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(gone.stdout)


@pytest.mark.parametrize("pid", ["99999999999999999999", "4294967296", "0"])
def test_a_leftover_claiming_an_impossible_pid_does_not_break_the_folder(
    tmp_path: Path, notices: list[str], pid: str
) -> None:
    """A pid past pid_t raised OverflowError from os.kill, and every write into the folder
    failed from then on. No process can own such a name: it is a leftover like any other."""
    name = f".x.{pid}-1-ab.moepack-tmp"
    (tmp_path / name).write_bytes(b"12345")
    write_group(tmp_path, ["out.txt"], "new")
    assert (tmp_path / "out.txt").read_text() == "new" and temps(tmp_path) == []
    assert len(notices) == 1 and name in notices[0] and "5 bytes" in notices[0]


def test_a_temporary_whose_name_holds_a_newline_is_swept(
    tmp_path: Path, notices: list[str]
) -> None:
    """A repack killed while writing ``new\\nline.gguf`` left a temporary the pattern missed."""
    name = f".new\nline.gguf.{dead_pid()}-5-0abc.moepack-tmp"
    (tmp_path / name).write_bytes(b"x" * 10)
    assert leftovers.is_temporary(name)
    write_group(tmp_path, ["out.txt"], "new")
    assert not (tmp_path / name).exists() and len(notices) == 1
    assert "new\\nline.gguf" in notices[0] and "\n" not in notices[0]  # one line


SWEEP_IN_CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from moepack import leftovers
    done = leftovers.sweep(Path(sys.argv[1]))
    print(done.unreadable, done.removed, done.completed)
    """
)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder", "huge"])
def test_a_journal_that_is_not_a_regular_file_is_not_read(tmp_path: Path, kind: str) -> None:
    """A FIFO named like a journal blocked every write into its folder; a symlink to
    /dev/zero was read until MemoryError. A child process: a regression fails by timeout."""
    name = f".moepack-commit.{dead_pid()}-1-00ff.moepack-journal"
    path = tmp_path / name
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "folder":
        path.mkdir()
    else:
        with open(path, "wb") as fh:
            fh.truncate(leftovers.MAX_JOURNAL_BYTES + 1)
    r = subprocess.run([sys.executable, "-c", SWEEP_IN_CHILD, str(tmp_path)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    if kind == "folder":  # not something moepack makes: left alone
        assert r.stdout.startswith("[] ") and path.is_dir()
    else:
        assert r.stdout.startswith(f"[{name!r}]") and not os.path.lexists(path)
    assert Path("/dev/zero").exists()


INTERRUPT_MID_SWEEP = textwrap.dedent(
    """
    import os, signal, sys
    from moepack import leftovers
    from moepack.cli.main import main
    real = leftovers._remove
    def remove_then_signal(path):
        ok = real(path)
        os.kill(os.getpid(), signal.SIGTERM)  # lands inside the sweep, after its first removal
        return ok
    leftovers._remove = remove_then_signal
    main(sys.argv[1:])
    """
)


def test_an_interrupt_during_the_sweep_is_not_held_until_it_ends(tmp_path: Path) -> None:
    """The whole sweep ran deferred: a sweep that blocked could only be ended by SIGKILL.
    Now SIGTERM ends it at once (exit 143), saying what it had removed."""
    pid = dead_pid()
    names = [f".t{i}.moetrace.{pid}-9-00{i:02x}.moepack-tmp" for i in range(5)]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    args = ["trace", "synth", str(tmp_path / "t.moetrace"), "--layers", "2", "--experts", "8",
            "--top-k", "2", "--tokens", "16", "-q"]  # fmt: skip
    r = subprocess.run([sys.executable, "-c", INTERRUPT_MID_SWEEP, *args],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 128 + signal.SIGTERM, r.stderr
    left = [n for n in names if (tmp_path / n).exists()]
    assert len(left) == 4 and not (tmp_path / "t.moetrace").exists()
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]  # click adds an empty line
    assert lines[0].startswith("moepack: warning: ") and names[0] in lines[0], r.stderr
    assert lines[1] == "moepack: interrupted; no output was written" and len(lines) == 2


def test_an_output_that_is_a_symlink_loop_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``Path.resolve`` raises RuntimeError on a symlink loop: comparing outputs with inputs
    (and with each other) was a traceback."""
    loop = tmp_path / "loop.moeplan"
    loop.symlink_to(loop.name)
    with pytest.raises(MoepackError, match="symlink that loops"):
        safeio.check_destination(loop, [tmp_path / "in.gguf"])
    code, _out, err = run_cli(capsys, "trace", "synth", loop.with_suffix(".moetrace"), "--layers",
                              2, "--experts", 8, "--top-k", 2, "--tokens", 16)  # fmt: skip
    assert code == 0, err  # not a loop: written
    (tmp_path / "l.moetrace").symlink_to("l.moetrace")
    code, _out, err = run_cli(capsys, "trace", "convert", loop.with_suffix(".moetrace"),
                              tmp_path / "l.moetrace")  # fmt: skip
    assert code == 2 and err.count("\n") == 1 and "symlink that loops" in err, err


@pytest.mark.parametrize("kind", ["fifo", "char-device"])
def test_an_output_that_is_a_device_or_a_fifo_is_refused_not_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """Outputs switch into place by rename, which replaced the node itself: run as root,
    ``--out /dev/zero`` left /dev/zero a regular file. A private node stands in for it."""
    import stat as st

    node = tmp_path / "node.moetrace"
    if kind == "fifo":
        os.mkfifo(node)
    else:
        try:
            os.mknod(node, st.S_IFCHR | 0o666, os.makedev(1, 3))  # what /dev/null is
        except PermissionError:
            pytest.skip("making a device node needs root")
    code, _out, err = run_cli(capsys, "trace", "synth", node, "--layers", 2, "--experts", 8,
                              "--top-k", 2, "--tokens", 16)  # fmt: skip
    assert code == 2 and err.count("\n") == 1, err
    assert "moepack writes over regular files only" in err
    mode = node.lstat().st_mode
    assert st.S_ISFIFO(mode) if kind == "fifo" else st.S_ISCHR(mode)
    assert temps(tmp_path) == []


def test_an_output_named_like_a_device_or_fifo_is_refused_not_replaced(tmp_path):
    """Switching an output into place renames over the destination: a FIFO (or, as root, a
    device node such as /dev/zero) would be replaced by a regular file."""
    fifo = tmp_path / "out.moetrace"
    os.mkfifo(fifo)
    with pytest.raises(BadInput, match="not a regular file"):
        check_destination(fifo, [])
    link = tmp_path / "link.gguf"
    link.symlink_to(fifo)
    with pytest.raises(BadInput, match="not a regular file"):
        check_destination(link, [])
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_an_existing_destination_is_replaced_only_when_asked(tmp_path: Path) -> None:
    """The one rule for every output: a file (or a symlink, dangling or not) at a destination
    is refused, and replaced only inside ``replacing`` (the command line's ``--force``)."""
    there, dangling = tmp_path / "r.gguf", tmp_path / "d.gguf"
    there.write_bytes(b"precious")
    dangling.symlink_to(tmp_path / "nowhere")
    for dest in (there, dangling):
        with pytest.raises(BadInput, match="already exists here; pass `force`"):
            check_destination(dest, [])
        with pytest.raises(BadInput, match="already exists"), AtomicOutputs() as out:
            out.open(dest).write(b"new")
    assert there.read_bytes() == b"precious" and temps(tmp_path) == []
    check_destination(tmp_path / "new.gguf", [])  # a new name needs nothing
    with replacing(False), pytest.raises(BadInput, match="already exists"):  # asks for nothing
        check_destination(there, [])
    with replacing():
        with replacing(False):  # and takes nothing away from an outer block
            assert safeio.replacing_allowed()
        with AtomicOutputs() as out:
            out.open(there).write(b"new")
        with pytest.raises(BadInput, match="overwrite the input"):  # inputs stay refused
            check_destination(there, [there])
    assert there.read_bytes() == b"new" and not safeio.replacing_allowed()
    with pytest.raises(BadInput, match="already exists"):  # only inside the block
        check_destination(there, [])
