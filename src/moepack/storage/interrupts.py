"""Holding interrupts while cleanup that must finish runs (reads in flight, buffers to free).

Python raises ``KeyboardInterrupt`` between any two bytecodes of the main thread, which can
cut cleanup code in half. ``hold_sigint`` swaps in a handler that only records the signal —
Ctrl-C, and SIGTERM/SIGHUP where the program turned them into ``KeyboardInterrupt`` too (the
CLI, ``moepack.interrupts``) — so the cleanup runs to its end; the caller then re-raises with
``deliver``. Only the main thread receives ``KeyboardInterrupt`` (and only it may set
handlers), so elsewhere this does nothing.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..interrupts import INTERRUPT_SIGNALS, Handlers

_held_signum: int = int(signal.SIGINT)  # the signal the latest hold recorded


class Held:
    """What ``hold_sigint`` saw: ``pressed()`` turns true at the first interrupt."""

    def __init__(self) -> None:
        self._count = 0
        self.previous: object = signal.default_int_handler

    def pressed(self) -> bool:
        return self._count > 0

    def _record(self, signum: int, frame: object) -> None:
        global _held_signum
        self._count += 1
        _held_signum = signum


def deliver(previous: object) -> None:
    """Act on a held interrupt as the handler that was in place would have: raise
    ``KeyboardInterrupt`` (Python's default), call a handler of the program's (with the
    signal that came), or nothing when SIGINT is ignored."""
    if previous is signal.SIG_IGN:
        return
    if callable(previous):
        previous(_held_signum, None)
        return
    raise KeyboardInterrupt


@contextmanager
def hold_sigint() -> Iterator[Held]:
    """Record interrupts instead of raising them while the block runs."""
    held = Held()
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    olds: Handlers = {}
    try:
        for sig in INTERRUPT_SIGNALS:
            old = signal.getsignal(sig)
            if sig == signal.SIGINT or callable(old):  # a default SIGTERM keeps ending us
                olds[int(sig)] = signal.signal(sig, held._record)
    except ValueError:  # not the main interpreter
        yield held
        return
    held.previous = olds[int(signal.SIGINT)]
    try:
        yield held
    finally:
        # None: a handler set outside Python; the closest we can put back is Python's own
        for num, old in olds.items():
            signal.signal(num, old if old is not None else signal.default_int_handler)
