"""Holding Ctrl-C while cleanup that must finish runs (reads in flight, buffers to free).

Python raises ``KeyboardInterrupt`` between any two bytecodes of the main thread, which can
cut cleanup code in half. ``hold_sigint`` swaps in a handler that only records the signal,
so the cleanup runs to its end; the caller then re-raises. Only the main thread receives
``KeyboardInterrupt`` (and only it may set handlers), so elsewhere this does nothing.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Held:
    """What ``hold_sigint`` saw: ``pressed()`` turns true at the first Ctrl-C."""

    def __init__(self) -> None:
        self._count = 0
        self.previous: object = signal.default_int_handler

    def pressed(self) -> bool:
        return self._count > 0

    def _record(self, signum: int, frame: object) -> None:
        self._count += 1


def deliver(previous: object) -> None:
    """Act on a held Ctrl-C as the handler that was in place would have: raise
    ``KeyboardInterrupt`` (Python's default), call a handler of the program's, or nothing
    when SIGINT is ignored."""
    if previous is signal.SIG_IGN:
        return
    if callable(previous):
        previous(signal.SIGINT, None)
        return
    raise KeyboardInterrupt


@contextmanager
def hold_sigint() -> Iterator[Held]:
    """Record Ctrl-C instead of raising it while the block runs."""
    held = Held()
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    try:
        old = signal.signal(signal.SIGINT, held._record)
    except ValueError:  # not the main interpreter
        yield held
        return
    held.previous = old
    try:
        yield held
    finally:
        # None: a handler set outside Python; the closest we can put back is Python's own
        signal.signal(signal.SIGINT, old if old is not None else signal.default_int_handler)
