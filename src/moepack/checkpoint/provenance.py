"""Recording a repack inside the GGUF it produced, so the file alone can be verified or undone.

Keys live under ``moepack.repack.`` (llama.cpp ignores metadata it does not know):

* ``moepack.repack.version`` (u32): 1
* ``moepack.repack.original_fingerprint`` (string): fingerprint of the unpermuted checkpoint
* ``moepack.repack.blocks`` (u32 array): blocks whose experts are permuted
* ``moepack.repack.perm.blk.<b>`` (u32 array): ``perm[slot] = original expert`` for block b

A repack that changes the layout as well (version 2) adds what undoing it needs:

* ``moepack.repack.fused`` (u32 array): blocks whose gate and up moepack fused into
  ``ffn_gate_up_exps``
* ``moepack.repack.alignment`` (u32): the original's ``general.alignment``, 0 when it had none
  (present only when the alignment changed)
* ``moepack.repack.order`` (u32 array): for every original tensor, in the original's order
  (shard after shard, tensor-info order), ``2 · i + h``: it is (half ``h`` of, for a fused
  tensor: 0 gate, 1 up) the ``i``-th tensor of this file, counted the same way
* ``moepack.repack.shards`` (u32 array): the original's tensor count per shard, present only
  when this file's shards were cut elsewhere (a split checkpoint rewritten on block boundaries)

Permutations are always relative to the original, so repacking a repacked file composes them,
and a composition that is the identity everywhere writes no keys at all: the original header,
byte for byte.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np
from gguf import GGUFValueType

from ..errors import BadInput
from ..keys import (
    REPACK_ALIGNMENT,
    REPACK_BLOCKS,
    REPACK_FUSED,
    REPACK_ORDER,
    REPACK_ORIGINAL,
    REPACK_PERM,
    REPACK_SHARDS,
    REPACK_VERSION,
)
from .model import MoeModel

KvEntry = tuple[str, GGUFValueType, object]
"""One metadata entry to write: key, GGUF value type, value."""

VERSION = 1
LAYOUT_VERSION = 2


@dataclass
class RepackProvenance:
    """What a repacked file says about itself."""

    original_fingerprint: str
    perms: dict[int, np.ndarray] = field(default_factory=dict)  # block -> perm vs original
    fused: list[int] = field(default_factory=list)  # blocks moepack fused
    alignment: int | None = None  # the original's general.alignment (0: none) when changed
    order: np.ndarray | None = None  # see the module docstring
    shards: list[int] | None = None  # the original's tensors per shard, when cut elsewhere

    @property
    def changes_layout(self) -> bool:
        """Whether the file differs from its original by more than expert permutations."""
        return (
            bool(self.fused)
            or self.alignment is not None
            or self.order is not None
            or self.shards is not None
        )

    def perm(self, block: int, n_expert: int) -> np.ndarray:
        p = self.perms.get(block)
        return p if p is not None else np.arange(n_expert, dtype=np.int64)

    def to_kv(self) -> list[KvEntry]:
        blocks = sorted(self.perms)
        version = LAYOUT_VERSION if self.changes_layout else VERSION
        out: list[KvEntry] = [
            (REPACK_VERSION, GGUFValueType.UINT32, version),
            (REPACK_ORIGINAL, GGUFValueType.STRING, self.original_fingerprint),
            (REPACK_BLOCKS, GGUFValueType.ARRAY, blocks),
        ]
        out += [(f"{REPACK_PERM}{b}", GGUFValueType.ARRAY, self.perms[b].tolist()) for b in blocks]
        if self.changes_layout:
            out.append((REPACK_FUSED, GGUFValueType.ARRAY, sorted(self.fused)))
            if self.alignment is not None:
                out.append((REPACK_ALIGNMENT, GGUFValueType.UINT32, self.alignment))
            order = self.order if self.order is not None else np.zeros(0, np.int64)
            out.append((REPACK_ORDER, GGUFValueType.ARRAY, order.tolist()))
            if self.shards is not None:
                out.append((REPACK_SHARDS, GGUFValueType.ARRAY, list(self.shards)))
        return out


def read_provenance(model: MoeModel) -> RepackProvenance | None:
    """The provenance recorded in ``model`` (None for a file moepack never permuted).

    Raises ``BadInput`` when the keys are present but inconsistent (unknown key, wrong version,
    a permutation that is not one, blocks that disagree with the per-block keys)."""
    kv = model.provenance()
    if not kv:
        return None
    where = model.shard_paths[0]
    version = kv.get(REPACK_VERSION)
    known = {REPACK_VERSION, REPACK_ORIGINAL, REPACK_BLOCKS}
    if version == LAYOUT_VERSION:
        known |= {REPACK_FUSED, REPACK_ALIGNMENT, REPACK_ORDER, REPACK_SHARDS}
    for key in kv:
        if key not in known and not key.startswith(REPACK_PERM):
            raise BadInput(f"unknown provenance key {key!r}", where)
    if version not in (VERSION, LAYOUT_VERSION):
        raise BadInput(f"unsupported provenance version {version!r}", where)
    original = kv.get(REPACK_ORIGINAL)
    if not isinstance(original, str) or not original:
        raise BadInput("provenance lacks the original fingerprint", where)
    blocks = kv.get(REPACK_BLOCKS)
    if not isinstance(blocks, list):
        raise BadInput("provenance block list is malformed", where)
    perms: dict[int, np.ndarray] = {}
    for key, value in kv.items():
        if not key.startswith(REPACK_PERM):
            continue
        suffix = key[len(REPACK_PERM) :]
        if not suffix.isdigit() or not isinstance(value, list):
            raise BadInput(f"malformed provenance key {key!r}", where)
        perms[int(suffix)] = np.asarray(value, dtype=np.int64)
    if sorted(perms) != sorted(int(b) for b in blocks):
        raise BadInput("provenance block list disagrees with its permutation keys", where)
    if version == VERSION:
        return RepackProvenance(original, perms)
    fused, order, alignment = kv.get(REPACK_FUSED), kv.get(REPACK_ORDER), kv.get(REPACK_ALIGNMENT)
    if not isinstance(fused, list) or not isinstance(order, list):
        raise BadInput("version 2 provenance lacks its fused block list or tensor order", where)
    if alignment is not None and not isinstance(alignment, int):
        raise BadInput("provenance alignment is malformed", where)
    shards = kv.get(REPACK_SHARDS)
    if shards is not None and (
        not isinstance(shards, list)
        or not 0 < len(shards) <= 99_999  # split names count in five digits
        or not all(isinstance(n, int) and n > 0 for n in shards)
        or sum(shards) != len(order)
    ):
        raise BadInput("provenance shard counts are malformed", where)
    return RepackProvenance(
        original,
        perms,
        fused=[int(b) for b in fused],
        alignment=alignment,
        order=np.asarray(order, dtype=np.int64),
        shards=[int(n) for n in shards] if shards is not None else None,
    )


# ----------------------------------------------------------------- serialisation
def _pack_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


_INT_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
}


def pack_kv(key: str, vtype: GGUFValueType, value: object) -> bytes:
    """One GGUF metadata entry: an integer, a string, or an array of u32 (all moepack's
    arrays are)."""
    out = _pack_str(key) + struct.pack("<I", int(vtype))
    if vtype in _INT_FORMATS:
        return out + struct.pack(_INT_FORMATS[vtype], int(value))  # type: ignore[call-overload]
    if vtype == GGUFValueType.STRING:
        return out + _pack_str(str(value))
    if vtype == GGUFValueType.ARRAY:
        items = np.asarray(value, dtype="<u4")
        return out + struct.pack("<IQ", int(GGUFValueType.UINT32), len(items)) + items.tobytes()
    raise ValueError(f"unsupported metadata type {vtype}")
