"""Announcing reads from a thread of its own: the announcements reach the kernel, the thread
ends when asked or when done, and nothing it is given (a FIFO, a missing file) can hold it."""

from __future__ import annotations

import os
import threading
import time

import pytest

from moepack.rewrite.readahead import ReadAhead, warm_start


def _threads(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def _wait_until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_read_ahead_stops_when_closed_whatever_it_still_has_to_announce(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(1 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        before = _threads("moepack-readahead")
        reads = [(fd, k * 4096, 4096) for k in range(256)]
        hints = ReadAhead(reads, ahead=8192)  # two reads ahead, then it waits for consumed()
        hints.consumed(4096)
        hints.close()
        assert _threads("moepack-readahead") == before
        with ReadAhead(reads, ahead=1 << 30):  # everything at once, then the thread ends
            pass
        assert _threads("moepack-readahead") == before
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_warm_start_skips_what_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    regular = tmp_path / "model.gguf"
    regular.write_bytes(bytes(64 * 1024))
    warm_start(fifo, tmp_path / "missing", tmp_path, regular)
    # opening the FIFO for reading would block until a writer came: the thread must end alone
    assert _wait_until(lambda: not _threads("moepack-warm"))
