"""Comparing in the files' memory maps: what is compared is released at once (the resident
set stays bounded by the look-ahead), and a file cut short under the comparer is an error
that names the byte, never a SIGBUS."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from moepack.errors import MoepackError
from moepack.rewrite.compare import CHUNK, pair_reads
from moepack.rewrite.mapped_compare import MAPPED_AHEAD, MappedComparer


def _rss_file() -> int:
    """Bytes of file pages mapped into this process's resident set."""
    status = Path("/proc/self/status").read_text()
    found = re.search(r"RssFile:\s+(\d+) kB", status)
    assert found is not None
    return int(found.group(1)) * 1024


@pytest.fixture
def pair(tmp_path):
    n = 24 * CHUNK + 777
    data = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8).tobytes()
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(data)
    b.write_bytes(data)
    return a, b, n


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_resident_set_stays_bounded_by_the_look_ahead(pair):
    a, b, n = pair
    fa, fb = os.open(a, os.O_RDONLY), os.open(b, os.O_RDONLY)
    try:
        before = _rss_file()
        peak = 0
        with MappedComparer() as cmp:
            cmp.expect(pair_reads(fa, 0, fb, 0, n))
            for k in range(0, n, CHUNK):  # the range in the comparer's own steps
                m = min(CHUNK, n - k)
                assert cmp.first_difference(fa, k, fb, k, m) is None
                peak = max(peak, _rss_file() - before)
            assert cmp.bytes_compared == n
        # both files are 2 x 96 MiB; without the release the maps would hold all of it
        assert peak <= MAPPED_AHEAD + 4 * CHUNK + (8 << 20)
    finally:
        os.close(fa)
        os.close(fb)


def test_a_file_cut_short_after_mapping_is_an_error_naming_the_byte(pair):
    a, b, n = pair
    fa, fb = os.open(a, os.O_RDONLY), os.open(b, os.O_RDWR)
    try:
        with MappedComparer() as cmp:
            cmp.expect(pair_reads(fa, 0, fb, 0, n))
            assert cmp.first_difference(fa, 0, fb, 0, CHUNK) is None  # mapped, looking ahead
            os.ftruncate(fb, 3 * CHUNK + 5)
            with pytest.raises(MoepackError, match=f"ended at byte {3 * CHUNK + 5:,}"):
                cmp.first_difference(fa, CHUNK, fb, CHUNK, n - CHUNK)
    finally:
        os.close(fa)
        os.close(fb)


def test_a_difference_after_a_remap_of_the_same_descriptor_number(pair, tmp_path):
    """Descriptor numbers are reused: a map is tied to the file, not to the number."""
    a, b, n = pair
    c = tmp_path / "c"
    flipped = bytearray(b.read_bytes())
    flipped[5 * CHUNK + 3] ^= 1
    c.write_bytes(flipped)
    fa = os.open(a, os.O_RDONLY)
    try:
        with MappedComparer() as cmp:
            fb = os.open(b, os.O_RDONLY)
            assert cmp.first_difference(fa, 0, fb, 0, n) is None
            os.close(fb)
            fc = os.open(c, os.O_RDONLY)  # most likely the same number as fb had
            try:
                assert cmp.first_difference(fa, 0, fc, 0, n) == 5 * CHUNK + 3
            finally:
                os.close(fc)
    finally:
        os.close(fa)
