"""The .q4nx container: round trip, and every malformed header named precisely."""

from __future__ import annotations

import json
import re
import struct

import numpy as np
import pytest

from moepack.errors import BadInput
from moepack.npu.q4nx import Q4nxFile, TensorSpec, write_q4nx


def _write(path, specs, data):
    with open(path, "wb") as fh:
        write_q4nx(fh, specs, lambda s: [data[s.name]], {"k": "v"})


def _raw(path, header: dict, data: bytes = b"", hlen: int | None = None):
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h) if hlen is None else hlen) + h + data)


def test_round_trip_alphabetical_and_mapped(tmp_path):
    specs = [
        TensorSpec("b", "BF16", (3, 2)),
        TensorSpec("a", "F32", (4,)),
        TensorSpec("c", "I8", (2, 1, 8)),
    ]
    rng = np.random.default_rng(0)
    data = {s.name: rng.integers(0, 256, s.nbytes, dtype=np.uint8) for s in specs}
    p = tmp_path / "x.q4nx"
    _write(p, specs, data)
    with Q4nxFile(p) as f:
        assert list(f.entries) == ["a", "b", "c"]
        assert [f.entries[n].begin for n in "abc"] == [0, 16, 28]
        assert f.data_start % 8 == 0
        assert f.metadata == {"k": "v"}
        for s in specs:
            assert bytes(f.raw(s.name)) == bytes(data[s.name])
        assert f.array("b").shape == (3, 2) and f.array("a").dtype == np.float32
        assert not f.u8.flags.writeable


@pytest.mark.parametrize(
    "header, data, message",
    [
        ({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "past its end"),
        ({"t": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4, "unknown dtype 'Q4'"),
        ({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16, "needs 16 bytes"),
        ({"t": {"dtype": "F32", "shape": [4], "data_offsets": [8, 4]}}, b"\0" * 16, "reversed"),
        ({"t": {"dtype": "F32", "shape": [4], "data_offsets": [-5, 11]}}, b"\0" * 16,
         "data_offsets [-5, 11] are negative"),
        ({"t": {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}}, b"\0" * 16, "shape"),
        ({"t": {"dtype": "F32", "shape": [4]}}, b"\0" * 16, "data_offsets"),
        (
            {"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
             "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]}},
            b"\0" * 16,
            "'a' [0, 8) and 'b' [4, 12) overlap",
        ),
        ([1, 2], b"", "not a JSON object"),
        ({"__metadata__": {"a": 1}}, b"", "__metadata__"),
    ],
)  # fmt: skip
def test_bad_headers_are_named(tmp_path, header, data, message):
    p = tmp_path / "bad.q4nx"
    _raw(p, header, data)
    with pytest.raises(BadInput, match=re.escape(message)) as e:
        Q4nxFile(p)
    assert e.value.path == str(p)


def test_duplicate_names_and_garbage(tmp_path):
    p = tmp_path / "dup.q4nx"
    h = b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}'
    p.write_bytes(struct.pack("<Q", len(h)) + h + b"\0\0")
    with pytest.raises(BadInput, match="names tensor 'a' twice"):
        Q4nxFile(p)
    p.write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(BadInput, match="not valid JSON"):
        Q4nxFile(p)
    p.write_bytes(b"abc")
    with pytest.raises(BadInput, match="too short"):
        Q4nxFile(p)
    _raw(p, {}, hlen=10_000)
    with pytest.raises(BadInput, match="header length 10,000 does not fit"):
        Q4nxFile(p)
    with pytest.raises(BadInput, match=": no such file$"):
        Q4nxFile(tmp_path / "missing.q4nx")


def test_truncated_real_model_names_the_tensor(model_path, tmp_path):
    cut = tmp_path / "cut.q4nx"
    data = model_path.read_bytes()
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(
        BadInput, match=r"tensor 'model\.layer\.3\..*' data ends at byte .* truncated"
    ):
        Q4nxFile(cut)


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"dtype": "U8", "shape": [10**30], "data_offsets": [0, 8]}, "needs ~1e+30 bytes"),
        ({"dtype": "U8", "shape": [2**32, 2**32], "data_offsets": [0, 0]}, "needs 18,446,744"),
        ({"dtype": "F32", "shape": [2**62, 4], "data_offsets": [0, 0]}, "needs 73,786,976,294,838,206,464"),
        ({"dtype": ["U8"], "shape": [1], "data_offsets": [0, 1]}, "unknown dtype ['U8']"),
        ({"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}, "not a list of sizes"),
        ({"dtype": "U8", "shape": [1], "data_offsets": [0, 1.0]}, "is not [begin, end]"),
    ],
)  # fmt: skip
def test_shapes_and_types_that_would_overflow_or_crash(tmp_path, entry, message):
    """Shape products are Python integers: [2**32, 2**32] must not wrap to 0 bytes."""
    p = tmp_path / "ovf.q4nx"
    _raw(p, {"t": entry}, b"\0" * 8)
    with pytest.raises(BadInput, match=re.escape(message)):
        Q4nxFile(p)


def test_hostile_header_text(tmp_path):
    p = tmp_path / "deep.q4nx"
    deep = b'{"t": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    p.write_bytes(struct.pack("<Q", len(deep)) + deep)
    with pytest.raises(BadInput, match="nested too deeply"):
        Q4nxFile(p)
    huge = b'{"t": {"dtype": "U8", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 1]}}'
    p.write_bytes(struct.pack("<Q", len(huge)) + huge)
    with pytest.raises(BadInput, match="not valid JSON"):
        Q4nxFile(p)
    with pytest.raises(BadInput) as e:
        Q4nxFile(tmp_path)  # a folder opens with O_RDONLY; reading it fails
    assert e.value.path == str(tmp_path)
