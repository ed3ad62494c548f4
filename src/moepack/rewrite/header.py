"""Rebuilding a GGUF header with moepack's provenance keys swapped in, everything else verbatim.

The original's metadata entries and tensor-info entries are copied as raw bytes (so values,
types and order are exactly preserved), moepack's own keys are removed and the new ones appended
after the last metadata entry. Tensor-info offsets are relative to the data section, so they stay
valid when the header grows; only the padding to the data section changes.
"""

from __future__ import annotations

import struct

from ..checkpoint.gguf_file import GgufFile
from ..checkpoint.model import PROVENANCE_PREFIX
from .provenance import KvEntry, pack_kv


def rebuild_header(shard: GgufFile, new_kv: list[KvEntry]) -> bytes:
    """Header bytes (magic .. last tensor info, no padding) with ``new_kv`` as moepack's keys."""
    raw = shard.reader.data
    kept = [kv for kv in shard.kv.values() if not kv.key.startswith(PROVENANCE_PREFIX)]
    kept.sort(key=lambda kv: kv.start)
    parts = [bytes(raw[0:8]), struct.pack("<QQ", len(shard.tensors), len(kept) + len(new_kv))]
    parts += [bytes(raw[kv.start : kv.end]) for kv in kept]
    parts += [pack_kv(k, t, v) for k, t, v in new_kv]
    if shard.tensors:
        first = min(t.info_start for t in shard.tensors)
        parts.append(bytes(raw[first : shard.header_end]))
    return b"".join(parts)


def padded(length: int, alignment: int) -> int:
    """``length`` rounded up to a multiple of ``alignment``."""
    return (length + alignment - 1) // alignment * alignment
