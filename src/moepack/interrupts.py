"""One set of interrupt signals, and sections of code that an interrupt cannot cut in half.

SIGINT, SIGTERM and SIGHUP all mean "stop, and clean up": the command line turns each into
``KeyboardInterrupt`` (``install``). Work that must not stop half-way — creating a temporary
*and* taking ownership of it, switching a group of outputs into place, removing temporaries —
runs inside ``deferred()``: a signal that lands there is recorded and raised as
``KeyboardInterrupt`` when the outermost section ends, so its work is whole.

An interrupt is raised once, at whatever bytecode the main thread runs, and code that catches
every exception there and goes on takes it away: Cython's set-up of every module with typed
memoryviews does (numpy.random's, imported on first use: ``try: Sequence.register(...)
except: pass``). Under the command line's handlers the interrupt is therefore also recorded
until the command ends, and loops that run long ask ``check()`` (or test ``raised()``) at
points where their normal work goes on, so a swallowed Ctrl-C still stops them.

The handler only reads and writes module state between bytecodes of the main thread, which is
where Python runs signal handlers; a section entered from another thread defers nothing (no
Python signal handler can run there).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

INTERRUPT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_depth = 0  # how many deferred() sections the main thread is inside
_pending: int | None = None  # a signal recorded inside a section, raised when it ends
_last: int | None = None  # the last signal turned into KeyboardInterrupt (for the exit code)
_wakeup: int | None = None  # wakeup_pipe's reading end
_armed = False  # install() put the command line's handlers in: an interrupt ends the command
_raised: list[int] = []  # interrupts raised as KeyboardInterrupt while armed (see raised())


class Stopped(KeyboardInterrupt):
    """An interrupt that ended work whose normal end is an interrupt (a server): ``account``
    says what the work did, for the line the command prints instead of "no output"."""

    def __init__(self, account: str) -> None:
        super().__init__(account)
        self.account = account


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """Raise ``KeyboardInterrupt`` now, or, inside a ``deferred()`` section, at its end."""
    global _pending
    if _depth > 0:
        _pending = signum
        return
    _raise(signum)


def _raise(signum: int) -> None:
    global _last
    _last = signum
    if _armed:
        _raised.append(signum)
    raise KeyboardInterrupt


def install() -> None:
    """Make every interrupt signal raise ``KeyboardInterrupt`` (the CLI does this first)."""
    global _armed
    _disarm()
    for sig in INTERRUPT_SIGNALS:
        signal.signal(sig, _on_signal)
    _armed = True


def ignore() -> None:
    """Ignore interrupt signals from now on: the work is done and said, only exiting is left."""
    for sig in INTERRUPT_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    _disarm()


def _disarm() -> None:
    global _armed
    _armed = False
    _raised.clear()


def raised() -> list[int]:
    """The interrupts the command line has raised as ``KeyboardInterrupt`` in the command
    running now, oldest first; empty until then, and outside the command line's handlers.

    The list itself, kept up to date: a hot loop may hold it in a local and test it for
    truth (one instruction) before calling ``check``."""
    return _raised


def check() -> None:
    """Raise ``KeyboardInterrupt`` again for an interrupt the command line already raised.

    For points where normal work goes on (a loop's next round, a measurement's start), never
    in cleanup: an interrupt that propagated is being handled there, and one that code
    catching every exception swallowed must still end the command."""
    if _raised:
        raise KeyboardInterrupt


def wakeup_pipe() -> int:
    """A descriptor that turns readable the moment a signal with a Python handler lands: one
    byte, the signal's number, written by Python's C-level handler itself. Python runs its
    handlers only when the main thread runs Python; a native thread watching this pipe sees
    an interrupt while the main thread waits inside native code (llama.cpp computing, a
    fault the expert pager serves). Made once per process, from the main thread, by a
    process that owns its signals (a llama.cpp worker); its native readers consume the bytes."""
    global _wakeup
    if _wakeup is None:
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        _wakeup = r
    return _wakeup


def wakeup_fd() -> int | None:
    """The reading end of ``wakeup_pipe``'s pipe, where this process made one."""
    return _wakeup


Handlers = dict[int, Callable[[int, FrameType | None], object] | int | None]


def saved_handlers() -> Handlers:
    """The handlers in place now, for ``restore``."""
    return {int(sig): signal.getsignal(sig) for sig in INTERRUPT_SIGNALS}


def restore(saved: Handlers) -> None:
    """Put back what ``saved_handlers`` saw (a handler set outside Python becomes the default).

    Where that ends the command line's handling, its record of raised interrupts goes too."""
    for sig, old in saved.items():
        signal.signal(sig, old if old is not None else signal.SIG_DFL)
    if not _installed():
        _disarm()


def last_signal() -> int:
    """The signal behind the latest ``KeyboardInterrupt`` (SIGINT when none was recorded)."""
    return _last if _last is not None else int(signal.SIGINT)


def _installed() -> bool:
    return signal.getsignal(signal.SIGINT) is _on_signal


class Forwarded:
    """What ``forwarding`` was sent: ``signals``, in order (empty: no interrupt came)."""

    def __init__(self) -> None:
        self.signals: list[int] = []


@contextmanager
def forwarding(forward: Callable[[int], None]) -> Iterator[Forwarded]:
    """While the block runs, hand each interrupt signal that would raise ``KeyboardInterrupt``
    to ``forward`` instead (from the handler, in the main thread), raising nothing.

    For a loop that reads what another process sends and must pass every interrupt on to it:
    an exception raised the instant a read has returned its data would lose that data (the
    signal and the data often come together: the other process answered, and the user
    stopped it). Signals that are ignored, left at their default action or handled by a
    handler of the caller's keep it; off the main thread nothing is swapped."""
    seen = Forwarded()
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        global _last
        seen.signals.append(signum)
        _last = signum  # the exit code a KeyboardInterrupt raised for it later would have
        forward(signum)

    swapped: Handlers = {}
    for sig in INTERRUPT_SIGNALS:
        old = signal.getsignal(sig)
        if old is _on_signal or old is signal.default_int_handler:
            swapped[int(sig)] = signal.signal(sig, handler)
    try:
        yield seen
    finally:
        restore(swapped)


@contextmanager
def deferred() -> Iterator[None]:
    """Run the block whole: an interrupt signal arriving inside it is raised when it ends.

    Outside the CLI (a library caller with Python's default SIGINT handling) the handler is
    put in place for the section and the caller's handling restored afterwards."""
    global _depth, _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    swapped: Handlers = {}
    if _depth == 0:
        _pending = None  # any older record was already raised outside a section
        if not _installed():
            swapped = _swap_in()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            restore(swapped)
            _deliver(_pending, swapped)


def _swap_in() -> Handlers:
    """Put ``_on_signal`` in for SIGINT where Python's default handler is in place (signals the
    caller left at their default action or ignores keep it)."""
    old = signal.getsignal(signal.SIGINT)
    if old is not signal.default_int_handler:
        return {}
    signal.signal(signal.SIGINT, _on_signal)
    return {int(signal.SIGINT): old}


def _deliver(signum: int | None, swapped: Handlers) -> None:
    global _pending
    if signum is None:
        return
    _pending = None
    handler = swapped.get(signum)
    if callable(handler) and handler is not signal.default_int_handler:
        handler(signum, None)
        return
    _raise(signum)
