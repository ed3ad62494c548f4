"""Every engine, in every mode it serves, returns exactly what a plain read returns."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from moepack.errors import BadInput
from moepack.storage import Mode, all_engines, open_file, read_ranges

READ_ENGINE_NAMES = list(all_engines())


def plain_read(path: Path, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        out = b""
        while len(out) < length:
            chunk = os.pread(fd, length - len(out), offset + len(out))
            if not chunk:
                break
            out += chunk
        return out
    finally:
        os.close(fd)


def odd_ranges(size: int, seed: int = 7) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    ranges = [(rng.randrange(0, size), rng.randrange(1, 300_000)) for _ in range(60)]
    return ranges + [
        (0, 1),
        (1, 1),
        (511, 2),  # straddles a block boundary
        (4095, 4097),
        (size - 1, 1),  # the last byte
        (size - 100, 5000),  # runs past the end of the file: short
        (size, 10),  # starts at the end: empty
        (size + 4096, 4096),  # past the end: empty
        (123, 0),  # zero length
        (0, size),  # the whole file
    ]


def cases() -> list[tuple[str, Mode, int]]:
    out = []
    engines = all_engines()
    for name, eng in engines.items():
        for mode in Mode:
            if mode not in eng.modes:
                continue
            for qd in [1] if eng.max_depth == 1 else [1, 3, 16]:
                out.append((name, mode, qd))
    return out


@pytest.mark.parametrize(("engine", "mode", "qd"), cases())
def test_engine_returns_plain_read_bytes(
    data_file: tuple[Path, bytes], engine: str, mode: Mode, qd: int
) -> None:
    path, data = data_file
    ranges = odd_ranges(len(data))
    out = read_ranges(path, ranges, engine=engine, mode=mode, queue_depth=qd, widen=True)
    for (off, n), got in zip(ranges, out.data, strict=True):
        assert got == plain_read(path, off, n), (engine, mode, qd, off, n)
        assert got == data[off : off + n]
    assert out.returned_bytes == sum(len(data[o : o + n]) for o, n in ranges)
    assert out.requested_bytes == sum(n for _, n in ranges)
    if mode is Mode.DIRECT:
        assert out.widened > 0
        assert out.device_bytes > out.returned_bytes  # widened spans read more than asked
    else:
        assert out.widened == 0
        assert out.device_bytes == out.returned_bytes


def test_direct_refuses_unaligned_request_without_widening(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    with open_file(path, Mode.DIRECT) as f:
        align = f.offset_align
        assert align >= 512 and align & (align - 1) == 0  # from statx or the device
        with pytest.raises(BadInput, match=rf"not aligned to {align} bytes"):
            read_ranges(f, [(0, align), (1, align)], engine="pread")
        ok = read_ranges(f, [(align, 2 * align)], engine="threads", queue_depth=2)
        assert ok.widened == 0 and ok.device_bytes == 2 * align


def test_widening_accounts_requested_vs_read(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    with open_file(path, Mode.DIRECT) as f:
        a = f.offset_align
        out = read_ranges(f, [(a + 3, 10)], engine="uring", queue_depth=2, widen=True)
    assert out.data == [data[a + 3 : a + 13]]
    assert (out.requested_bytes, out.returned_bytes, out.device_bytes, out.widened) == (
        10,
        10,
        a,
        1,
    )


def test_direct_read_of_unaligned_file_tail(data_file: tuple[Path, bytes]) -> None:
    """The file's size is not a multiple of the block: the last aligned span reads short."""
    path, data = data_file
    with open_file(path, Mode.DIRECT) as f:
        a = f.offset_align
        start = len(data) // a * a
        for engine in ("pread", "threads", "uring", "uring-batch"):
            out = read_ranges(f, [(start, a)], engine=engine)
            assert out.data == [data[start:]] and 0 < len(data) - start < a


def test_engines_refuse_what_they_cannot_do(data_file: tuple[Path, bytes]) -> None:
    path, _ = data_file
    with pytest.raises(BadInput, match="cannot read in O_DIRECT mode"):
        read_ranges(path, [(0, 10)], engine="mmap", mode=Mode.DIRECT)
    with pytest.raises(BadInput, match="queue depth 1 only"):
        read_ranges(path, [(0, 10)], engine="pread", queue_depth=4)
    with pytest.raises(BadInput, match="unknown engine 'aio'"):
        read_ranges(path, [(0, 10)], engine="aio")
    with pytest.raises(BadInput, match="offset and length must be >= 0"):
        read_ranges(path, [(-1, 10)], engine="pread")


def test_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "empty"
    p.write_bytes(b"")
    for engine in READ_ENGINE_NAMES:
        out = read_ranges(p, [(0, 100), (5, 1)], engine=engine)
        assert out.data == [b"", b""]


@pytest.mark.parametrize("engine", ["pread", "threads", "uring", "uring-batch"])
def test_aligned_direct_reads_need_no_widening(data_file: tuple[Path, bytes], engine: str) -> None:
    path, data = data_file
    with open_file(path, Mode.DIRECT) as f:
        a = f.offset_align
        rng = random.Random(11)
        blocks = len(data) // a
        ranges = [(rng.randrange(blocks) * a, rng.randrange(1, 64) * a) for _ in range(40)]
        out = read_ranges(f, ranges, engine=engine, queue_depth=1 if engine == "pread" else 8)
    assert out.widened == 0
    assert out.data == [data[o : o + n] for o, n in ranges]
    assert out.device_bytes == out.returned_bytes
