"""The ``.q4nx`` container: ``u64 json_len | JSON header | tensor data`` (safetensors layout).

Read through one read-only memory map so a 21 GB file costs only the pages a layer touches;
every header entry is validated (dtype, shape x dtype == byte span, offsets inside the file,
no overlaps, no duplicate names) before any tensor is handed out. Writing is streamed, for
synthetic files and for unpacked buffers: the header is computed up front, data arrives in
bounded chunks.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ..errors import BadInput
from ..inputs import load_json, regular_file
from ..pages import release_mapped
from ..safeio import os_error_text

DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
MAX_HEADER = 256 * 1024 * 1024
HEADER_ALIGN = 8
METADATA_KEY = "__metadata__"


@dataclass(frozen=True)
class Q4nxTensor:
    """One header entry; ``begin``/``end`` are relative to the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def spec(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(k)
        out[k] = v
    return out


class _Duplicate(Exception):
    pass


def parse_header(
    raw: bytes, data_size: int, path: str | os.PathLike[str]
) -> tuple[dict[str, Q4nxTensor], dict[str, str]]:
    """Validate a header against a data section of ``data_size`` bytes."""
    try:
        doc = load_json(raw, path, "header", pairs_hook=_reject_duplicates, int64_only=False)
    except _Duplicate as e:
        raise BadInput(f"header names tensor {e.args[0]!r} twice", path) from None
    if not isinstance(doc, dict):
        raise BadInput("header is not a JSON object", path)
    meta_raw = doc.pop(METADATA_KEY, {})
    if not isinstance(meta_raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta_raw.items()
    ):
        raise BadInput(f"{METADATA_KEY!r} must map strings to strings", path)
    entries: dict[str, Q4nxTensor] = {}
    for name, raw in doc.items():
        entries[name] = _entry(name, raw, data_size, path)
    by_begin = sorted(entries.values(), key=lambda t: (t.begin, t.end))
    for prev, cur in zip(by_begin, by_begin[1:], strict=False):
        if cur.begin < prev.end and cur.nbytes and prev.nbytes:
            raise BadInput(
                f"tensors {prev.name!r} [{prev.begin:,}, {prev.end:,}) and {cur.name!r} "
                f"[{cur.begin:,}, {cur.end:,}) overlap",
                path,
            )
    return entries, dict(meta_raw)


def _entry(name: str, e: object, data_size: int, path: str | os.PathLike[str]) -> Q4nxTensor:
    if not isinstance(e, dict):
        raise BadInput(f"tensor {name!r}: entry is not an object", path)
    dtype, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise BadInput(f"tensor {name!r}: unknown dtype {dtype!r}", path)
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise BadInput(f"tensor {name!r}: shape {shape!r} is not a list of sizes", path)
    if (
        not isinstance(offs, list)
        or len(offs) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
    ):
        raise BadInput(f"tensor {name!r}: data_offsets {offs!r} is not [begin, end]", path)
    begin, end = offs
    if begin < 0 or end < 0:
        raise BadInput(f"tensor {name!r}: data_offsets [{begin}, {end}] are negative", path)
    if end < begin:
        raise BadInput(f"tensor {name!r}: data_offsets [{begin}, {end}] are reversed", path)
    need = math.prod(shape) * DTYPE_SIZES[dtype]  # Python ints: no int64 wrap-around
    if end - begin != need:
        raise BadInput(
            f"tensor {name!r}: {dtype}{shape} needs {_count(need)} bytes, data_offsets span "
            f"{_count(end - begin)}",
            path,
        )
    if end > data_size:
        raise BadInput(
            f"tensor {name!r} data ends at byte {_count(end)} of the data section, past its end "
            f"({data_size:,} bytes): the file is truncated",
            path,
        )
    return Q4nxTensor(name, dtype, tuple(shape), begin, end)


def _count(n: int) -> str:
    """A byte count for a message; absurd ones (a forged header) stay short."""
    return f"{n:,}" if n < 10**30 else f"~{n:.3g}"


class Q4nxFile:
    """A validated, memory-mapped ``.q4nx`` file. Use as a context manager."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        regular_file(self.path, "file")  # a FIFO would block the open below
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise BadInput(os_error_text(e), path) from None
        try:
            self._open(fd, path)
        except OSError as e:  # a folder, a device, an I/O error while reading the header
            raise BadInput(os_error_text(e), path) from None
        finally:
            os.close(fd)
        self._u8: np.ndarray | None = np.frombuffer(self._mm, dtype=np.uint8)

    def _open(self, fd: int, path: str | os.PathLike[str]) -> None:
        size = os.fstat(fd).st_size
        if size < 8:
            raise BadInput(f"file is {size} bytes, too short for a .q4nx header", path)
        (hlen,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        if hlen > MAX_HEADER or 8 + hlen > size:
            raise BadInput(
                f"header length {hlen:,} does not fit the file ({size:,} bytes): "
                "truncated or not a .q4nx",
                path,
            )
        raw = os.pread(fd, hlen, 8)
        self.size = size
        self.data_start = 8 + hlen
        if len(raw) != hlen:
            raise BadInput(f"header is {hlen:,} bytes, only {len(raw):,} could be read", path)
        self.entries, self.metadata = parse_header(raw, size - self.data_start, path)
        self._mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)

    # -- access -----------------------------------------------------------------
    @property
    def u8(self) -> np.ndarray:
        """The whole file as a read-only uint8 array (a view of the map, no copy)."""
        if self._u8 is None:
            raise ValueError("file is closed")
        return self._u8

    def entry(self, name: str) -> Q4nxTensor:
        try:
            return self.entries[name]
        except KeyError:
            raise BadInput(f"tensor {name!r} is missing", self.path) from None

    def raw(self, name: str) -> np.ndarray:
        """A tensor's bytes as a uint8 view of the map."""
        e = self.entry(name)
        return self.u8[self.data_start + e.begin : self.data_start + e.end]

    def array(self, name: str) -> np.ndarray:
        """A tensor as a typed view (BF16 as uint16 bit patterns, F8 as uint8)."""
        e = self.entry(name)
        return self.raw(name).view(NUMPY_DTYPES[e.dtype]).reshape(e.shape)

    def drop_pages(self, start: int, end: int) -> None:
        """Release this process's pages of file bytes [start, end) (page cache keeps them).

        Pages of a file map that were touched count towards RSS; dropping each layer's pages
        once it is packed keeps peak memory flat across 40 layers.
        """
        release_mapped(self._mm, start, end)

    def find(self, needle: bytes, start: int, end: int) -> int:
        """File offset of ``needle`` in ``[start, end)``, or -1."""
        return self._mm.find(needle, start, end)

    def close(self) -> None:
        self._u8 = None
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the map goes when it does

    def __enter__(self) -> Q4nxFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


NUMPY_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "F8_E4M3": np.dtype(np.uint8),
    "F8_E5M2": np.dtype(np.uint8),
    "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"),
    "F32": np.dtype("<f4"),
    "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"),
    "F64": np.dtype("<f8"),
}


# -- writing --------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """What a writer needs to lay out one tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


def layout(
    specs: Iterable[TensorSpec], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[tuple[TensorSpec, int]]]:
    """Header bytes (with the u64 length prefix) and each tensor's data offset.

    Tensors are ordered alphabetically, as the runtime's files are; the header is padded
    with spaces to 8 bytes like safetensors so the data section starts aligned.
    """
    ordered = sorted(specs, key=lambda s: s.name)
    names = [s.name for s in ordered]
    if len(set(names)) != len(names):
        raise BadInput("the same tensor name appears twice")
    doc: dict[str, object] = {}
    if metadata:
        doc[METADATA_KEY] = dict(metadata)
    placed: list[tuple[TensorSpec, int]] = []
    off = 0
    for s in ordered:
        doc[s.name] = {
            "dtype": s.dtype,
            "shape": list(s.shape),
            "data_offsets": [off, off + s.nbytes],
        }
        placed.append((s, off))
        off += s.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % HEADER_ALIGN)
    return struct.pack("<Q", len(raw)) + raw, placed


Producer = Callable[[TensorSpec], Iterable[np.ndarray | bytes]]


def write_q4nx(
    fh: BinaryIO,
    specs: Iterable[TensorSpec],
    produce: Producer,
    metadata: dict[str, str] | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> int:
    """Stream a ``.q4nx`` into an open file; ``produce(spec)`` yields the tensor's bytes in
    chunks. Returns the file size. A producer that yields the wrong byte count is a bug and
    raises ``ValueError``."""
    header, placed = layout(specs, metadata)
    fh.write(header)
    total = len(header)
    for spec, _off in placed:
        got = 0
        for chunk in produce(spec):
            mv = (chunk.data if isinstance(chunk, np.ndarray) else memoryview(chunk)).cast("B")
            fh.write(mv)
            got += mv.nbytes
            if on_bytes:
                on_bytes(mv.nbytes)
        if got != spec.nbytes:
            raise ValueError(f"{spec.name}: produced {got} bytes, expected {spec.nbytes}")
        total += got
    return total


def file_size(specs: Iterable[TensorSpec], metadata: dict[str, str] | None = None) -> int:
    header, placed = layout(specs, metadata)
    return len(header) + sum(s.nbytes for s, _ in placed)
