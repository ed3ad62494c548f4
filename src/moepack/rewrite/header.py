"""Rebuilding a GGUF header: moepack's provenance keys swapped in, everything else verbatim
(``rebuild_header``), or assembled from entries for a file whose layout changes.

The original's metadata entries and tensor-info entries are copied as raw bytes (so values,
types and order are exactly preserved), moepack's own keys are removed and the new ones appended
after the last metadata entry. Tensor-info offsets are relative to the data section, so they stay
valid when the header grows; only the padding to the data section changes.
"""

from __future__ import annotations

import struct

from gguf import GGUFValueType, Keys

from ..checkpoint.gguf_file import GgufFile
from ..checkpoint.provenance import KvEntry, pack_kv
from ..errors import BadInput
from ..keys import REPACK_PREFIX


def rebuild_header(shard: GgufFile, new_kv: list[KvEntry]) -> bytes:
    """Header bytes (magic .. last tensor info, no padding) with ``new_kv`` as moepack's keys."""
    raw = shard.reader.data
    kept = [kv for kv in shard.kv.values() if not kv.key.startswith(REPACK_PREFIX)]
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


def assemble_header(shard: GgufFile, kvs: list[bytes], infos: list[bytes]) -> bytes:
    """Header bytes (no padding) of a file with ``shard``'s magic and version, the metadata
    entries ``kvs`` and the tensor-info entries ``infos``, each already encoded."""
    raw = shard.reader.data
    head = bytes(raw[0:8]) + struct.pack("<QQ", len(infos), len(kvs))
    return head + b"".join(kvs) + b"".join(infos)


def kept_metadata(shard: GgufFile) -> list[tuple[str, bytes]]:
    """``shard``'s metadata entries in file order, moepack's own keys left out, as raw bytes."""
    kept = [kv for kv in shard.kv.values() if not kv.key.startswith(REPACK_PREFIX)]
    kept.sort(key=lambda kv: kv.start)
    return [(kv.key, shard.raw_kv(kv.key)) for kv in kept]


def set_alignment(
    kvs: list[tuple[str, bytes]], shard: GgufFile, alignment: int | None
) -> list[tuple[str, bytes]]:
    """``kvs`` with ``general.alignment`` set to ``alignment`` (in place when the key is there,
    appended otherwise), or removed for ``None``. Raises ``BadInput`` for a key that is not a
    u32, which is the only type llama.cpp's GGUF reader accepts for it."""
    kv = shard.kv.get(Keys.General.ALIGNMENT)
    if kv is not None and kv.value_type != GGUFValueType.UINT32:
        raise BadInput(f"{Keys.General.ALIGNMENT} is a {kv.value_type.name}, not a u32", shard.path)
    rest = [(k, raw) for k, raw in kvs if k != Keys.General.ALIGNMENT]
    if alignment is None:
        return rest
    entry = (
        Keys.General.ALIGNMENT,
        pack_kv(Keys.General.ALIGNMENT, GGUFValueType.UINT32, alignment),
    )
    if kv is None:
        return rest + [entry]
    return [entry if k == Keys.General.ALIGNMENT else (k, raw) for k, raw in kvs]


def set_tensor_count(
    kvs: list[tuple[str, bytes]], shard: GgufFile, count: int
) -> list[tuple[str, bytes]]:
    """``kvs`` with a split checkpoint's ``split.tensors.count`` (when present) set to
    ``count``, in its own integer type: fusing two tensors into one changes it."""
    key = Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT
    kv = shard.kv.get(key)
    if kv is None:
        return kvs
    raw = pack_kv(key, kv.value_type, count)
    return [(k, raw if k == key else r) for k, r in kvs]
