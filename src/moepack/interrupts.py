"""The signals that interrupt moepack, and holding them while cleanup that must finish runs.

Ctrl-C (SIGINT), SIGTERM and SIGHUP all mean "stop now": outputs in progress are removed and
inputs stay untouched, whichever of the three arrived. ``raise_on_interrupt_signals`` makes
SIGTERM and SIGHUP raise ``KeyboardInterrupt`` as Ctrl-C does (the command line installs it),
so one ``except KeyboardInterrupt`` path serves all three.

Python raises ``KeyboardInterrupt`` between any two bytecodes of the main thread, which can
cut cleanup code in half. ``hold_interrupts`` swaps in a handler that only records the
signal, so the cleanup runs to its end; the caller then delivers it (``deliver``). Only the
main thread receives signals (and only it may set handlers), so elsewhere this does nothing.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import NoReturn

INTERRUPT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Every signal moepack treats as "stop now, clean up"."""

Handler = Callable[[int, FrameType | None], object] | int | None


def _raise_interrupt(signum: int, frame: FrameType | None) -> NoReturn:
    raise KeyboardInterrupt


def raise_on_interrupt_signals() -> None:
    """Make every interrupt signal raise ``KeyboardInterrupt`` (SIGINT already does)."""
    for sig in INTERRUPT_SIGNALS:
        if sig != signal.SIGINT:
            signal.signal(sig, _raise_interrupt)


class Held:
    """What ``hold_interrupts`` saw: ``pressed()`` turns true at the first interrupt signal;
    ``previous`` is the handler that was in place for it (for SIGINT until one arrives)."""

    def __init__(self) -> None:
        self._count = 0
        self.signum: int = signal.SIGINT
        self.handlers: dict[int, Handler] = {signal.SIGINT: signal.default_int_handler}

    @property
    def previous(self) -> Handler:
        return self.handlers.get(self.signum)

    def pressed(self) -> bool:
        return self._count > 0

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self._count == 0:
            self.signum = signum
        self._count += 1


def deliver(previous: Handler, signum: int = signal.SIGINT) -> None:
    """Act on a held interrupt as the handler that was in place would have: raise
    ``KeyboardInterrupt`` (Python's default for SIGINT), call a handler of the program's, or
    nothing when the signal is ignored."""
    if previous is signal.SIG_IGN:
        return
    if callable(previous):
        previous(signum, None)
        return
    raise KeyboardInterrupt


@contextmanager
def hold_interrupts() -> Iterator[Held]:
    """Record every interrupt signal instead of acting on it while the block runs."""
    held = Held()
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    installed: dict[int, Handler] = {}
    try:
        for sig in INTERRUPT_SIGNALS:
            installed[sig] = signal.signal(sig, held._record)
    except ValueError:  # not the main interpreter
        _restore(installed)
        yield held
        return
    held.handlers.update(installed)
    try:
        yield held
    finally:
        _restore(installed)


def _restore(installed: dict[int, Handler]) -> None:
    for sig, old in installed.items():
        # None: a handler set outside Python; the closest we can put back is Python's own
        if old is None:
            old = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        signal.signal(sig, old)
