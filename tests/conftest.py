"""The test process's interrupt signals: Python's defaults from the start, and kept by every test.

The interrupt tests send real signals to this process and to the Python programs it starts,
and a started program inherits an ignored disposition and the blocked mask. A suite started
as a background job of a shell without job control (`./dev test > log &` in a script, a CI
runner's step) starts with SIGINT ignored, and Python keeps it ignored: every test that
expects Ctrl-C to raise, here or in a child, then fails. So the session starts from what a
terminal gives (SIGINT raising ``KeyboardInterrupt``, SIGTERM and SIGHUP at their default
action, none blocked), and a test that leaves those signals handled, ignored or blocked
otherwise than it found them fails in its own teardown (the state put back), instead of
failing the interrupt tests that run after it.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

WATCHED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_MASK = sum(1 << (int(s) - 1) for s in WATCHED)


def _kernel_bits() -> dict[str, int]:
    """The watched signals' bits in this process's ignored and caught sets (a handler set
    by native code, outside Python, shows here only)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("SigIgn", "SigCgt"):
            out[key] = int(value, 16) & _MASK
    return out


def signal_state() -> dict[str, object]:
    """The watched signals' handlers, as Python and the kernel see them, and which of them
    the main thread blocks."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    kernel = _kernel_bits()
    state: dict[str, object] = {f"{s.name} handler": signal.getsignal(s) for s in WATCHED}
    for s in WATCHED:
        bit = 1 << (int(s) - 1)
        ignored, caught = kernel["SigIgn"] & bit, kernel["SigCgt"] & bit
        state[f"{s.name} in the kernel"] = (
            "ignored" if ignored else "caught" if caught else "default"
        )
        state[f"{s.name} blocked"] = s in blocked
    return state


def _changes(before: dict[str, object], after: dict[str, object]) -> str:
    return "; ".join(f"{k}: {before[k]!r} -> {after[k]!r}" for k in before if before[k] != after[k])


def python_defaults() -> None:
    """SIGINT raising ``KeyboardInterrupt``, SIGTERM and SIGHUP at their default action (a
    handler of a plugin's stays), none of them blocked."""
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, WATCHED)


def _put_back(state: dict[str, object], mask: Iterable[int]) -> None:
    for sig in WATCHED:
        old = state[f"{sig.name} handler"]
        signal.signal(sig, old if old is not None else signal.SIG_DFL)  # type: ignore[arg-type]
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def pytest_configure(config: pytest.Config) -> None:
    python_defaults()


@pytest.fixture(autouse=True)
def interrupt_signals_kept() -> Iterator[None]:
    """Fail the test that changed how this process takes interrupt signals."""
    before = signal_state()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    after = signal_state()
    if after != before:
        _put_back(before, mask)
        pytest.fail(f"the test left this process's signals changed: {_changes(before, after)}")
