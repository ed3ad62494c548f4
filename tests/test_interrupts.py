"""One set of interrupt signals: SIGTERM and SIGHUP act as Ctrl-C, and are held like it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from moepack.interrupts import INTERRUPT_SIGNALS, deliver, hold_interrupts


def test_the_set_is_sigint_sigterm_sighup() -> None:
    assert set(INTERRUPT_SIGNALS) == {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_held_termination_signal_waits_for_the_block_then_interrupts(sig: int) -> None:
    # In a child: the handlers are process-wide, and the test must see the real default.
    code = textwrap.dedent(
        f"""
        import os, signal, sys
        from moepack.interrupts import deliver, hold_interrupts, raise_on_interrupt_signals
        raise_on_interrupt_signals()
        finished = False
        try:
            with hold_interrupts() as held:
                os.kill(os.getpid(), {int(sig)})
                for _ in range(100000):
                    if held.pressed():
                        break
                finished = True  # the cleanup ran to its end
            assert held.pressed() and held.signum == {int(sig)}
            assert signal.getsignal({int(sig)}) is held.previous
            deliver(held.previous, held.signum)
        except KeyboardInterrupt:
            sys.exit(7 if finished else 3)
        sys.exit(0)
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 7, run.stderr


def test_handlers_are_restored_and_an_ignored_signal_stays_ignored() -> None:
    before = {s: signal.getsignal(s) for s in INTERRUPT_SIGNALS}
    with hold_interrupts() as held:
        assert signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM]
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(100000):
            if held.pressed():
                break
        assert held.signum == signal.SIGHUP
    assert {s: signal.getsignal(s) for s in INTERRUPT_SIGNALS} == before
    deliver(signal.SIG_IGN, signal.SIGHUP)
