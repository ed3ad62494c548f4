"""The read-ahead comparer: the same answers as a byte-by-byte comparison, wherever the
difference lies relative to its chunks, whether or not the reads were announced, and no
reader thread left behind."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from moepack.errors import MoepackError
from moepack.rewrite.compare import CHUNK, RangeComparer, pair_reads, single_reads
from moepack.rewrite.mapped_compare import MappedComparer


@pytest.fixture(params=[RangeComparer, MappedComparer], ids=["buffers", "mapped"])
def Comparer(request):
    """Both comparers give the same answers: each test runs with each."""
    return request.param


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 3 * CHUNK + 12345, dtype=np.uint8).tobytes()
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(data)
    b.write_bytes(data)
    return a, b, data


def _fds(*paths):
    return [os.open(p, os.O_RDONLY) for p in paths]


@pytest.mark.parametrize("announced", [True, False])
@pytest.mark.parametrize("at", [0, 7, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 12344])
def test_first_difference_is_exact_at_chunk_edges(files, Comparer, announced, at):
    a, b, data = files
    flipped = bytearray(data)
    flipped[at] ^= 0x40
    b.write_bytes(flipped)
    fa, fb = _fds(a, b)
    try:
        with Comparer() as cmp:
            if announced:
                cmp.expect(pair_reads(fa, 0, fb, 0, len(data)))
            assert cmp.first_difference(fa, 0, fb, 0, len(data)) == at
            # the comparer stays usable after a difference: a later, unannounced range
            assert cmp.first_difference(fa, at + 1, fb, at + 1, len(data) - at - 1) is None
    finally:
        os.close(fa)
        os.close(fb)


def test_announced_sequence_with_slices_out_of_order_and_padding(files, Comparer):
    a, b, data = files
    step = CHUNK // 2 + 3
    perm = [3, 0, 5, 1, 4, 2]
    # b holds a's slices in ``perm`` order, then 100 zero bytes
    b.write_bytes(b"".join(data[e * step : (e + 1) * step] for e in perm) + bytes(100))
    fa, fb = _fds(a, b)
    try:
        with Comparer() as cmp:
            reads = []
            for slot, e in enumerate(perm):
                reads += pair_reads(fa, e * step, fb, slot * step, step)
            reads += single_reads(fb, 6 * step, 100)
            cmp.expect(reads)
            for slot, e in enumerate(perm):
                assert cmp.first_difference(fa, e * step, fb, slot * step, step) is None
            assert cmp.first_nonzero(fb, 6 * step, 100) is None
            assert cmp.bytes_compared == 6 * step
            # a slice compared against the wrong expert differs at its first byte or so
            assert cmp.first_difference(fa, 0, fb, 0, step) is not None
    finally:
        os.close(fa)
        os.close(fb)


def test_a_file_that_ends_early_is_an_error_not_a_hang(files, Comparer):
    a, b, data = files
    b.write_bytes(data[: CHUNK + 10])
    fa, fb = _fds(a, b)
    try:
        with Comparer() as cmp:
            cmp.expect(pair_reads(fa, 0, fb, 0, len(data)))
            with pytest.raises(MoepackError, match="ended at byte"):
                cmp.first_difference(fa, 0, fb, 0, len(data))
    finally:
        os.close(fa)
        os.close(fb)


def _reader_threads() -> list[threading.Thread]:
    # only the comparer's own readers: other threads in the test process (pools of other
    # tests, still winding down) may come and go meanwhile
    return [t for t in threading.enumerate() if t.name.startswith("moepack-read")]


def test_no_reader_thread_outlives_the_comparer(files, Comparer):
    a, b, data = files
    before = _reader_threads()
    fa, fb = _fds(a, b)
    try:
        cmp = Comparer()
        cmp.expect(pair_reads(fa, 0, fb, 0, len(data)))
        assert cmp.first_difference(fa, 0, fb, 0, CHUNK) is None  # stop early: reads pending
        assert len(_reader_threads()) > len(before)  # the readers did start
        cmp.close()
    finally:
        os.close(fa)
        os.close(fb)
    assert _reader_threads() == before
