"""How many bytes a GGUF header (metadata and tensor index) takes, from its first bytes.

A remote file is read in growing pieces: this scanner walks the header as far as the bytes
at hand allow and says how many more it needs (``NeedMore``), so only the header and the
tensor index are ever fetched, never tensor data. It checks counts against caps as it goes,
so a hostile or corrupt header cannot make it ask for gigabytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

GGUF_MAGIC = b"GGUF"
MAX_HEADER = 256 << 20  # a real header is a few MB (a 256k vocabulary is ~5 MB)
MAX_COUNT = 1 << 24  # tensors, metadata keys, array items
MAX_STRING = 64 << 20

# GGUF value types: fixed sizes; 8 = string, 9 = array
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class NeedMore(Exception):
    """The header runs past the bytes at hand: at least ``size`` bytes are needed."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


class NotGguf(ValueError):
    """The bytes are not a GGUF header (the message says why)."""


@dataclass(frozen=True)
class HeaderExtent:
    """Where the header ends: ``index_end`` is one past the last tensor-info entry,
    ``data_offset`` where tensor data starts (aligned)."""

    version: int
    n_tensors: int
    index_end: int
    data_offset: int
    alignment: int


class _Cursor:
    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > MAX_HEADER:
            raise NotGguf(f"header longer than {MAX_HEADER >> 20} MiB: corrupt")
        if end > len(self.buf):
            raise NeedMore(end)
        out = self.buf[self.pos : end]
        self.pos = end
        return out

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def count(self, what: str) -> int:
        n = self.u64()
        if n > MAX_COUNT:
            raise NotGguf(f"{what} count {n:,} is absurd: corrupt header")
        return n

    def string(self) -> bytes:
        n = self.u64()
        if n > MAX_STRING:
            raise NotGguf(f"a string of {n:,} bytes in the header: corrupt")
        return self.take(n)

    def value(self, vtype: int, depth: int = 0) -> object:
        if vtype in _FIXED:
            raw = self.take(_FIXED[vtype])
            return int.from_bytes(raw, "little") if vtype in (4, 10) else None
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY and depth == 0:
            itype = self.u32()
            n = self.count("array item")
            if itype in _FIXED:
                self.take(n * _FIXED[itype])
            else:
                for _ in range(n):
                    self.value(itype, depth + 1)
            return None
        raise NotGguf(f"unknown metadata value type {vtype}: corrupt header")


def scan_header(buf: bytes) -> HeaderExtent:
    """The extent of the GGUF header at the start of ``buf``; ``NeedMore`` when ``buf`` ends
    inside it, ``NotGguf`` when it is no GGUF header."""
    c = _Cursor(buf)
    magic = c.take(4)
    if magic != GGUF_MAGIC:
        raise NotGguf(f"not a GGUF file (it starts with {magic!r}, expected b'GGUF')")
    version = c.u32()
    if version not in (2, 3):
        raise NotGguf(f"unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors = c.count("tensor")
    n_kv = c.count("metadata key")
    alignment = 32
    for _ in range(n_kv):
        key = c.string()
        vtype = c.u32()
        value = c.value(vtype)
        if key == b"general.alignment" and isinstance(value, int) and value > 0:
            alignment = value
    for _ in range(n_tensors):
        c.string()
        n_dims = c.u32()
        if n_dims > 8:
            raise NotGguf(f"a tensor with {n_dims} dimensions: corrupt header")
        c.take(8 * n_dims + 4 + 8)
    end = c.pos
    return HeaderExtent(version, n_tensors, end, -(-end // alignment) * alignment, alignment)
