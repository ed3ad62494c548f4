"""Sections an interrupt cannot cut in half, with real signals sent to this process."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from moepack import interrupts
from moepack.storage.interrupts import deliver, hold_sigint


@pytest.fixture
def cli_handlers() -> Iterator[None]:
    """The handlers the command line installs, put back afterwards."""
    saved = interrupts.saved_handlers()
    interrupts.install()
    try:
        yield
    finally:
        interrupts.restore(saved)


def test_a_signal_inside_a_section_is_raised_when_the_outermost_ends() -> None:
    steps = []
    with pytest.raises(KeyboardInterrupt), interrupts.deferred():
        with interrupts.deferred():
            signal.raise_signal(signal.SIGINT)
            steps.append("inner")
        steps.append("outer")  # the inner section's end raises nothing yet
    assert steps == ["inner", "outer"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_without_a_signal_a_section_is_transparent() -> None:
    with interrupts.deferred():
        pass
    with pytest.raises(KeyboardInterrupt):  # and a later signal is raised at once again
        signal.raise_signal(signal.SIGINT)


@pytest.mark.parametrize("sig", interrupts.INTERRUPT_SIGNALS)
def test_every_interrupt_signal_is_deferred_and_remembered(cli_handlers: None, sig: int) -> None:
    done = False
    with pytest.raises(KeyboardInterrupt), interrupts.deferred():
        signal.raise_signal(sig)
        done = True
    assert done and interrupts.last_signal() == sig


def test_holding_for_cleanup_also_holds_sigterm_under_the_cli(cli_handlers: None) -> None:
    with hold_sigint() as held:
        signal.raise_signal(signal.SIGTERM)  # recorded, not raised: the cleanup goes on
        assert held.pressed()
    assert signal.getsignal(signal.SIGTERM) is signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        deliver(held.previous)
    assert interrupts.last_signal() == signal.SIGTERM  # exit 143, not 130


_WAKEUP = """
import os, signal, sys
from moepack import interrupts
assert interrupts.wakeup_fd() is None
for sig in interrupts.INTERRUPT_SIGNALS:
    signal.signal(sig, lambda signum, frame: None)
fd = interrupts.wakeup_pipe()
assert interrupts.wakeup_pipe() == fd == interrupts.wakeup_fd()  # made once
os.kill(os.getpid(), signal.SIGTERM)
os.kill(os.getpid(), signal.SIGINT)
sys.stdout.write(os.read(fd, 16).hex())
"""


def test_each_interrupt_is_a_byte_on_the_wakeup_pipe_for_native_threads() -> None:
    """What a native thread (the expert pager's) reads while the main thread is in C; in a
    process of its own (the wakeup descriptor is the whole process's)."""
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src"
    r = subprocess.run(
        [sys.executable, "-c", _WAKEUP],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert bytes.fromhex(r.stdout) == bytes([signal.SIGTERM, signal.SIGINT])


def _swallow(sig: int = signal.SIGINT) -> None:
    """A signal raised as ``KeyboardInterrupt`` inside code that catches every exception and
    goes on (Cython's module set-up does, in numpy.random: ``except: pass``)."""
    try:
        signal.raise_signal(sig)
    except BaseException:
        pass


def test_an_interrupt_something_swallowed_is_raised_again_at_the_next_check(
    cli_handlers: None,
) -> None:
    interrupts.check()  # nothing came: nothing is raised
    _swallow(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        interrupts.check()
    with pytest.raises(KeyboardInterrupt):  # and at every later one: the command is stopping
        interrupts.check()
    assert interrupts.last_signal() == signal.SIGTERM  # exit 143, as when it was not lost


def test_a_swallowed_interrupt_inside_a_section_is_raised_again_too(cli_handlers: None) -> None:
    try:
        with interrupts.deferred():
            signal.raise_signal(signal.SIGINT)
    except BaseException:
        pass
    with pytest.raises(KeyboardInterrupt):
        interrupts.check()


def test_the_record_ends_with_the_command_lines_handlers() -> None:
    """In-process runs (tests, ``main(argv)``) leave nothing that stops later work."""
    saved = interrupts.saved_handlers()
    interrupts.install()
    try:
        _swallow()
    finally:
        interrupts.restore(saved)
    interrupts.check()
    interrupts.install()
    try:
        _swallow()
        interrupts.ignore()  # the command ended: only reporting and leaving are left
        interrupts.check()
    finally:
        interrupts.restore(saved)


def test_without_the_command_lines_handlers_a_caught_interrupt_stays_caught() -> None:
    """A library caller with Python's own handling keeps its meaning of catching one."""
    _swallow()
    try:
        with interrupts.deferred():  # swaps the deferring handler in for the section
            signal.raise_signal(signal.SIGINT)
    except KeyboardInterrupt:
        pass
    interrupts.check()
