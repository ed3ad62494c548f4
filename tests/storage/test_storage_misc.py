"""Sizes as users type them, the heatmap, and the engines listing."""

from __future__ import annotations

import json

import pytest

from moepack.errors import BadInput
from moepack.storage.heatmap import heatmap_png
from moepack.storage.surface import Surface, SurfaceCell
from moepack.storage.units import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "value"),
    [("4096", 4096), ("4K", 4096), ("64KiB", 65536), ("1m", 1 << 20), ("2G", 2 << 30),
     ("1.5M", 1536 << 10), (" 8 kb ", 8192),
     # exact past a float's 53 bits: 2**63-1 read as a float became 2**63, past int64
     ("9223372036854775807", (1 << 63) - 1), ("9007199254740993", (1 << 53) + 1),
     ("8589934591.5K", (1 << 43) - 512)],
)  # fmt: skip
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "K", "-4K", "0", "1.3", "4X", "0.5K1"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(BadInput):
        parse_size(text)


def test_format_size_round_trips() -> None:
    for n in (4096, 65536, 1 << 20, 32 << 20, 2 << 30, 1000):
        assert parse_size(format_size(n)) == n


def test_heatmap_of_a_ragged_surface() -> None:
    s = Surface(
        [SurfaceCell(4096, 1, 2e7), SurfaceCell(65536, 8, 6e8), SurfaceCell(1 << 20, 1, 7e8)]
    )
    png = heatmap_png(s, title="ragged")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_engines_command_lists_engines_modes_and_bindings(run_cli, tmp_path) -> None:
    r = run_cli("engines", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    names = [e["name"] for e in doc["engines"]]
    assert names == ["pread", "threads", "uring", "uring-batch", "mmap"]
    assert doc["modes"]["unsupported"]["buffered"] is None
    assert doc["dio_align"]["offset"] > 0
    assert {b["name"] for b in doc["bindings"]} == {"liburing", "pyuring", "ctypes (built in)"}
    assert list(tmp_path.iterdir()) == []  # the trial file is gone


@pytest.mark.parametrize("huge", [True, False])
@pytest.mark.parametrize(
    ("count", "size", "align"), [(1, 100, 1), (3, 65536, 512), (2, 5000, 8192)]
)
def test_buffer_pool_alignment_and_isolation(
    monkeypatch: pytest.MonkeyPatch, huge: bool, count: int, size: int, align: int
) -> None:
    from moepack.storage import buffers

    monkeypatch.setattr(buffers, "use_huge_pages", huge)
    pool = buffers.BufferPool(count, size, align)
    try:
        assert len(pool.views) == count and all(len(v) == size for v in pool.views)
        assert all(a % max(align, 4096) == 0 for a in pool.addresses)
        hp = buffers.huge_page_size()
        if huge and hp:
            assert pool.addresses[0] % hp == 0
        for i, v in enumerate(pool.views):
            v[:] = bytes([i + 1]) * size
        assert [bytes(v) for v in pool.views] == [bytes([i + 1]) * size for i in range(count)]
    finally:
        pool.close()


def test_closed_pools_are_reused_with_their_pages_and_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool made again gets the same memory (the same physical pages, so 4 KiB-page buffers
    keep their layout instead of coming back in reverse order); abandoned pools never come
    back; idle memory is bounded."""
    from moepack.storage import buffers

    monkeypatch.setattr(buffers, "_IDLE", [])
    monkeypatch.setattr(buffers, "use_huge_pages", False)
    a = buffers.BufferPool(4, 65536, 512)
    first = a.addresses
    a.views[0][:3] = b"abc"
    a.close()
    assert a.closed and a.views == []
    b = buffers.BufferPool(4, 65536, 512)
    assert b.addresses == first
    c = buffers.BufferPool(4, 65536, 512)  # b is still open: c is new memory
    assert c.addresses != first
    b.abandon()
    d = buffers.BufferPool(4, 65536, 512)
    assert d.addresses != first  # never the abandoned memory
    for p in (c, d):
        p.close()
    monkeypatch.setattr(buffers, "IDLE_LIMIT", 300_000)
    big = buffers.BufferPool(8, 65536, 512)  # 512 KiB: over the limit, unmapped on close
    big.close()
    assert all(k[0] <= 300_000 for k, _ in buffers._IDLE)
    assert sum(k[0] for k, _ in buffers._IDLE) <= 300_000
    buffers.release_idle()
    assert buffers._IDLE == []


def test_held_ctrl_c_is_recorded_then_delivered_as_the_old_handler_would() -> None:
    import os
    import signal

    from moepack.storage.interrupts import deliver, hold_sigint

    before = signal.getsignal(signal.SIGINT)
    with hold_sigint() as held:
        os.kill(os.getpid(), signal.SIGINT)  # not raised inside the block
        for _ in range(1000):
            if held.pressed():
                break
        assert held.pressed() and held.previous is before
    assert signal.getsignal(signal.SIGINT) is before
    with pytest.raises(KeyboardInterrupt):
        deliver(signal.default_int_handler)
    deliver(signal.SIG_IGN)  # a program that ignores Ctrl-C keeps ignoring it
