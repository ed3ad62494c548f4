"""Announcing reads from a thread of its own: the announcements reach the kernel, and the
thread ends when asked, whatever it still had to announce, or by itself once done."""

from __future__ import annotations

import os
import threading
import time

import pytest

from moepack.pages import drop_cached
from moepack.storage import linux
from moepack.storage.readahead import ReadAhead


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


def test_the_announcements_reach_the_kernel(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(8 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        drop_cached(fd)
        try:
            cached_before = linux.cachestat(fd).nr_cache
        except OSError:
            pytest.skip("no cachestat(2) on this kernel")
        pages = (8 << 20) // linux.PAGE_SIZE
        if cached_before > pages // 2:
            pytest.skip("this filesystem keeps its pages (tmpfs?): nothing to read in")
        before = _threads("moepack-readahead")
        reads = [(fd, k << 20, 1 << 20) for k in range(8)]
        with ReadAhead(reads, ahead=1 << 30):  # all of it at once
            assert _wait_until(lambda: _threads("moepack-readahead") == before)
        # every page of the file is read in (the kernel may drop a few again under pressure)
        assert _wait_until(lambda: linux.cachestat(fd).nr_cache >= pages * 9 // 10)
    finally:
        os.close(fd)
