"""The suite's interrupt signals (tests/conftest.py): Python's defaults however the suite was
started, and a test that leaves them changed is the test that fails."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")

_TESTS = textwrap.dedent(
    """
    import signal, subprocess, sys
    import pytest

    def test_ctrl_c_raises_here():
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)

    def test_a_started_python_takes_ctrl_c():
        code = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
        assert subprocess.run([sys.executable, "-c", code], capture_output=True,
                              text=True).stdout.strip() == "True"

    def test_nothing_is_blocked_or_ignored():
        assert not signal.pthread_sigmask(signal.SIG_BLOCK, []) & {signal.SIGINT, signal.SIGTERM}
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    def test_b_leaves_sigterm_ignored():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def test_c_leaves_sigint_blocked():
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    def test_d_after_them_all_is_as_before():
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    """
)

# the suite as a shell's background job starts it: SIGINT (and SIGQUIT) ignored; here
# SIGTERM ignored and SIGINT blocked too, as another launcher might leave them
_LAUNCH = textwrap.dedent(
    """
    import os, signal, sys
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    os.execv(sys.executable, [sys.executable, "-m", "pytest", *sys.argv[1:]])
    """
)


def test_a_suite_started_ignoring_ctrl_c_runs_with_python_defaults_and_names_a_leak(
    tmp_path: Path,
) -> None:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_signals.py").write_text(_TESTS)
    r = subprocess.run(
        [sys.executable, "-c", _LAUNCH, "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    out = r.stdout
    assert "6 passed, 2 errors" in out, out  # each leak fails in its own teardown, no later test
    sigterm = (
        "SIGTERM handler: <Handlers.SIG_DFL: 0> -> <Handlers.SIG_IGN: 1>; "
        "SIGTERM in the kernel: 'default' -> 'ignored'"
    )
    assert "ERROR at teardown of test_b_leaves_sigterm_ignored" in out and sigterm in out, out
    assert "ERROR at teardown of test_c_leaves_sigint_blocked" in out, out
    assert "changed: SIGINT blocked: False -> True\n" in out, out
