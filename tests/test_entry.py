"""The command's interrupt handling at the instants that used to go wrong: while the heavy
imports run, the instant the output is in place, and after the command has finished. Each
child process sends itself the real signal at that exact instant (no timing involved)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CHILD = textwrap.dedent(
    """
    import builtins, os, signal, sys
    when, signum = sys.argv[1], int(sys.argv[2])
    sys.argv = ["moepack", *sys.argv[3:]]
    def fire():
        os.kill(os.getpid(), signum)
    # click is the first heavy import; numpy comes with the command's module, which the
    # command line imports only when the command runs (under its own handlers by then)
    heavy = "numpy" if when.startswith("command-") else "click"
    when = when.removeprefix("command-")
    if when == "import":  # while click (the first heavy import) is being imported
        real_import = builtins.__import__
        def hook(name, *a, **k):
            if name == heavy and builtins.__import__ is hook:
                builtins.__import__ = real_import
                fire()
            return real_import(name, *a, **k)
        builtins.__import__ = hook
    if when == "setname":  # inside a class body's __set_name__, as numpy's finfo has one
        real_import = builtins.__import__
        class Descriptor:
            def __set_name__(self, owner, name):
                fire()
        def hook(name, *a, **k):
            if name == heavy and builtins.__import__ is hook:
                builtins.__import__ = real_import
                type("Finfo", (), {"epsneg": Descriptor()})
            return real_import(name, *a, **k)
        builtins.__import__ = hook
    from moepack.entry import main
    if when == "committed":  # the instant the output is in place
        from moepack import leftovers, safeio
        real_apply = leftovers.Journal.apply
        def apply_then_signal(self, *a, **k):
            placed = real_apply(self, *a, **k)
            fire()
            return placed
        leftovers.Journal.apply = apply_then_signal
        real_switch = safeio._FolderOutput.switch
        def switch_then_signal(self):  # a folder output: switched in whole
            real_switch(self)
            fire()
        safeio._FolderOutput.switch = switch_then_signal
    if when == "finished":  # the command returned, interrupts are not yet ignored
        from moepack import interrupts
        real_ignore = interrupts.ignore
        def signal_then_ignore():
            interrupts.ignore = real_ignore
            fire()
            real_ignore()
        interrupts.ignore = signal_then_ignore
    main()
    """
)


def run_child(when: str, sig: int, *args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD, when, str(sig), *map(str, args)],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "in.pmxtrace"
    r = run_child(
        "none",
        0,
        "trace",
        "synth",
        path,
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
    assert r.returncode == 0, r.stderr
    return path


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_while_importing_is_one_line(tmp_path: Path, trace: Path, sig: int) -> None:
    out = tmp_path / "out.moetrace"
    r = run_child("import", sig, "trace", "convert", trace, out)
    assert r.returncode == 128 + sig, r.stderr
    assert r.stderr == "moepack: interrupted; no output was written\n"
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["in.pmxtrace"]


def test_a_signal_inside_a_descriptor_set_up_while_importing_is_one_line(
    tmp_path: Path, trace: Path
) -> None:
    """Python 3.11 reports it as RuntimeError('Error calling __set_name__ ...')."""
    out = tmp_path / "out.moetrace"
    r = run_child("setname", signal.SIGTERM, "trace", "convert", trace, out)
    assert r.returncode == 143, r.stderr
    assert r.stderr == "moepack: interrupted; no output was written\n"
    assert not out.exists()


@pytest.mark.parametrize("when", ["command-import", "command-setname"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_command_module_imports_is_one_line(
    tmp_path: Path, trace: Path, when: str, sig: int
) -> None:
    """The command's module, and numpy with it, are imported when the command runs."""
    out = tmp_path / "out.moetrace"
    r = run_child(when, sig, "trace", "convert", trace, out)
    assert r.returncode == 128 + sig, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln]  # click closes a terminal's ^C first
    assert lines == ["moepack: interrupted; no output was written"], r.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["in.pmxtrace"]


def test_a_signal_after_the_output_is_complete_says_what_was_written(
    tmp_path: Path, trace: Path
) -> None:
    out = tmp_path / "out.moetrace"
    r = run_child("committed", signal.SIGINT, "plan", "--help")  # writes nothing: no commit
    assert r.returncode == 0, r.stderr
    r = run_child("committed", signal.SIGINT, "trace", "convert", trace, out, "-q")
    assert r.returncode == 130, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln]  # click closes a terminal's ^C first
    assert lines == [
        f"moepack: interrupted after writing {out} (complete); nothing else was written"
    ]
    ref = tmp_path / "ref.moetrace"
    done = run_child("none", 0, "trace", "convert", trace, ref, "-q")
    assert done.returncode == 0, done.stderr
    assert out.stat().st_size == ref.stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "in.pmxtrace",
        "out.moetrace",
        "ref.moetrace",
    ]


def test_a_signal_after_the_command_finished_lets_it_finish(tmp_path: Path, trace: Path) -> None:
    out, ref = tmp_path / "out.txt", tmp_path / "ref.txt"
    r = run_child("finished", signal.SIGTERM, "trace", "convert", trace, out)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "" and r.stdout
    assert run_child("none", 0, "trace", "convert", trace, ref, "-q").returncode == 0
    assert out.read_bytes() == ref.read_bytes()


def test_a_signal_after_a_pack_is_complete_says_where_its_files_are(tmp_path: Path) -> None:
    model, pack = tmp_path / "m.q4nx", tmp_path / "pack"
    assert run_child("none", 0, "npu", "synth", model, "--layers", "0", "-q").returncode == 0
    r = run_child("committed", signal.SIGTERM, "npu", "pack", model, "--out", pack, "-q")
    assert r.returncode == 143, r.stderr
    files = sorted(p.name for p in pack.iterdir())
    assert "manifest.json" in files and not [f for f in files if ".moepack-" in f]
    assert not [p for p in tmp_path.iterdir() if ".moepack-" in p.name]
    lines = [ln for ln in r.stderr.splitlines() if ln]
    assert lines == [
        f"moepack: interrupted after writing {pack} (complete); nothing else was written"
    ]
