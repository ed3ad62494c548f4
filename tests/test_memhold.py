"""The memory holder's own checks of its floor (the holding itself is the benchmarks')."""

import subprocess
import sys


def _hold(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "moepack.memhold", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_floor_too_close_to_running_out_is_refused() -> None:
    p = _hold("--leave", "1G", "--floor", "64M")
    assert p.returncode == 2
    assert "--floor must be at least 128 MiB" in p.stderr


def test_leaving_less_than_the_floor_is_refused() -> None:
    p = _hold("--leave", "200M", "--floor", "256M")
    assert p.returncode == 2
    assert "at least the floor (256 MiB)" in p.stderr
