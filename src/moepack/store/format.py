"""The expert store's on-disk frame: a fixed header, the expert records, a JSON index.

One file, little-endian, documented in docs/store.md::

    [0, data_offset)            header (HEADER struct, zero padded to the alignment)
    [data_offset, data_end)     expert records, each starting on a multiple of the alignment
    [index_offset, +index_len)  the index: UTF-8 JSON (``index.py``), its sha256 in the header

The header is written last, so a file whose header is incomplete is never mistaken for a
store; the index's digest makes a torn or edited index a clear error, not a wrong offset.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = b"MOESTORE"
VERSION = 1
HEADER = struct.Struct("<8sIIQQQQQ32s")
"""magic, version, reserved (0), alignment, data_offset, data_end, index_offset, index_length,
sha256(index)."""
MIN_ALIGNMENT = 4096
"""Records start on at least this boundary: O_DIRECT reads need the device's logical block
(512 B or 4 KiB) and page alignment of offsets and lengths."""
MAX_ALIGNMENT = 1 << 30
EXTENSION = ".moestore"


@dataclass(frozen=True)
class Header:
    """Where a store's regions lie (absolute offsets in the file)."""

    alignment: int
    data_offset: int
    data_end: int
    index_offset: int
    index_length: int
    index_sha256: bytes
    version: int = VERSION

    def pack(self) -> bytes:
        return HEADER.pack(
            MAGIC,
            self.version,
            0,
            self.alignment,
            self.data_offset,
            self.data_end,
            self.index_offset,
            self.index_length,
            self.index_sha256,
        )


def unpack_header(raw: bytes) -> Header | str:
    """The header in ``raw`` (the file's first bytes), or why it is not a store's."""
    if len(raw) < HEADER.size:
        return f"is {len(raw)} bytes long, shorter than a store header ({HEADER.size} bytes)"
    magic, version, _reserved, align, d0, d1, i0, ilen, digest = HEADER.unpack_from(raw)
    if magic != MAGIC:
        return f"is not a moepack expert store (magic {magic!r}, expected {MAGIC!r})"
    if version != VERSION:
        return f"is an expert store of format version {version}; moepack reads version {VERSION}"
    return Header(align, d0, d1, i0, ilen, digest, version)


def check_alignment(alignment: int) -> str | None:
    """Why ``alignment`` cannot be a store's record alignment (None when it can)."""
    if alignment < MIN_ALIGNMENT or alignment > MAX_ALIGNMENT:
        return f"alignment must be {MIN_ALIGNMENT} to {MAX_ALIGNMENT} bytes, got {alignment}"
    if alignment & (alignment - 1):
        return f"alignment must be a power of two, got {alignment}"
    return None


def align_up(x: int, alignment: int) -> int:
    """The first multiple of ``alignment`` at or after ``x``."""
    return -(-x // alignment) * alignment
