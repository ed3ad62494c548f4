"""The ctypes io_uring ring and the subprocess checks of PyPI bindings."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from moepack.storage.buffers import BufferPool
from moepack.storage.uring import bindings
from moepack.storage.uring.ring import Ring, ring_unavailable_reason

pytestmark = pytest.mark.skipif(ring_unavailable_reason() is not None, reason="no io_uring here")


def test_ring_reads_and_reports_errors(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    fd = os.open(path, os.O_RDONLY)
    ring = Ring(3)
    pool = BufferPool(3, 1000)
    try:
        assert ring.entries == 4 and ring.space() == 4
        ring.prep_read(fd, pool.addresses[0], 1000, 17, 0, 0)
        ring.prep_read(fd, pool.addresses[1], 1000, len(data) - 10, 0, 1)
        ring.prep_read(-1 & 0x7FFFFFFF, pool.addresses[2], 10, 0, 0, 2)  # a bad descriptor
        ring.submit_and_wait(3)
        got = dict(ring.reap())
        assert got[0] == 1000 and bytes(pool.views[0]) == data[17:1017]
        assert got[1] == 10 and bytes(pool.views[1][:10]) == data[-10:]
        assert got[2] < 0  # -EBADF, reported, not raised
        assert ring.ready() == 0 and ring.reap() == []
    finally:
        ring.close()
        pool.close()
        os.close(fd)


def test_binding_that_dies_of_sigill_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """A binding that kills its process (as PyPI liburing does here) cannot take us down."""
    monkeypatch.setattr(
        bindings,
        "_CHECKS",
        {
            "crashes": "import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n",
            "missing": "import moepack_no_such_binding\n",
            "works": "print('ok 1.2')\n",
        },
    )
    got = {b.name: b for b in bindings.check_bindings(timeout=30)}
    assert not got["crashes"].usable and "SIGILL" in got["crashes"].detail
    assert not got["missing"].usable and got["missing"].detail == "not installed"
    assert got["works"].usable and "1.2" in got["works"].detail
    assert got["ctypes (built in)"].usable
    assert sys.executable  # the checks ran in child processes of this interpreter
