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
from gguf.constants import GGUF_DEFAULT_ALIGNMENT

from ..checkpoint.gguf_file import GgufFile
from ..checkpoint.model import MoeModel
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


_SPLIT_FORM = (
    (Keys.Split.LLM_KV_SPLIT_NO, GGUFValueType.UINT16),
    (Keys.Split.LLM_KV_SPLIT_COUNT, GGUFValueType.UINT16),
    (Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, GGUFValueType.INT32),
)
KEEP = -1
"""``shard_metadata``'s alignment: leave ``general.alignment`` as the shard has it."""


def split_keys(no: int, count: int, n_tensors: int) -> list[tuple[str, bytes]]:
    """A split checkpoint's bookkeeping as gguf-split and gguf-py write it: shard number and
    count (u16) and the tensor count of all shards (i32), in this order."""
    values = (no, count, n_tensors)
    return [(k, pack_kv(k, t, v)) for (k, t), v in zip(_SPLIT_FORM, values, strict=True)]


def _later_shard(no: int, count: int, n_tensors: int, alignment: int) -> list[tuple[str, bytes]]:
    """A later shard's whole metadata as gguf-split writes it: the split keys, and
    ``general.alignment`` where the data is not on GGUF's default alignment."""
    kvs = split_keys(no, count, n_tensors)
    if alignment != GGUF_DEFAULT_ALIGNMENT:
        key = Keys.General.ALIGNMENT
        kvs.append((key, pack_kv(key, GGUFValueType.UINT32, alignment)))
    return kvs


def check_recut(model: MoeModel) -> None:
    """``BadInput`` unless ``model``'s split bookkeeping is what gguf-split and gguf-py write,
    so that its shards can be cut elsewhere and the original's put back byte for byte: the
    first shard's metadata ends in the split keys (a single file has none), each later
    shard's is the split keys alone (with ``general.alignment`` off the default)."""
    n, total = len(model.shards), len(model.tensors)
    first = kept_metadata(model.shards[0])
    if n == 1:
        if Keys.Split.LLM_KV_SPLIT_COUNT in model.shards[0].kv:
            raise BadInput(
                "a single file with split metadata cannot be cut into shards (its keys would "
                "not come back as they were)",
                model.shard_paths[0],
            )
        return
    if first[-3:] != split_keys(0, n, total):
        raise BadInput(
            "its split keys are not the last entries of the first shard's metadata, in "
            "gguf-split's types (u16, u16, i32): its shards cannot be cut elsewhere and put back",
            model.shard_paths[0],
        )
    for i, shard in enumerate(model.shards[1:], 1):
        if kept_metadata(shard) != _later_shard(i, n, total, shard.alignment):
            raise BadInput(
                "holds metadata beyond the split keys (or in other types than gguf-split's): "
                "its shards cannot be cut elsewhere and put back byte for byte",
                model.shard_paths[i],
            )


def shard_metadata(
    model: MoeModel, index: int, count: int, n_tensors: int, alignment: int | None = KEEP
) -> list[tuple[str, bytes]]:
    """The metadata (moepack's keys aside) of shard ``index`` of ``count`` of a rewrite of
    ``model`` holding ``n_tensors`` tensors in all, its data on ``alignment`` (``KEEP``: as the
    shard has it; ``None``: GGUF's default, the key removed).

    With as many shards as ``model``, each shard keeps its own metadata (the tensor count and
    alignment set). With another count (a split cut on block boundaries, or undone), the first
    shard keeps the model's metadata with the split keys at its end (none for one shard) and
    every later shard is gguf-split's form (``check_recut`` says whether ``model`` allows it)."""
    if count == len(model.shards):
        shard = model.shards[index]
        kvs = kept_metadata(shard)
        if alignment != KEEP and alignment != shard.alignment:
            kvs = set_alignment(kvs, shard, alignment)
        return set_tensor_count(kvs, shard, n_tensors)
    check_recut(model)
    first = model.shards[0]
    final = first.alignment if alignment == KEEP else (alignment or GGUF_DEFAULT_ALIGNMENT)
    if index > 0:
        return _later_shard(index, count, n_tensors, final)
    kvs = kept_metadata(first)
    if len(model.shards) > 1:
        kvs = kvs[:-3]  # the split keys (check_recut): written anew below, or left out
    if alignment != KEEP and alignment != first.alignment:
        kvs = set_alignment(kvs, first, alignment)
    return kvs + (split_keys(0, count, n_tensors) if count > 1 else [])
