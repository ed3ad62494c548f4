"""Recording a repack inside the GGUF it produced, so the file alone can be verified or undone.

Keys live under ``moepack.repack.`` (llama.cpp ignores metadata it does not know):

* ``moepack.repack.version`` (u32): 1
* ``moepack.repack.original_fingerprint`` (string): fingerprint of the unpermuted checkpoint
* ``moepack.repack.blocks`` (u32 array): blocks whose experts are permuted
* ``moepack.repack.perm.blk.<b>`` (u32 array): ``perm[slot] = original expert`` for block b

Permutations are always relative to the original, so repacking a repacked file composes them,
and a composition that is the identity everywhere writes no keys at all: the original header,
byte for byte.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np
from gguf import GGUFValueType

from ..checkpoint.model import PROVENANCE_PREFIX, MoeModel
from ..errors import BadInput

KvEntry = tuple[str, GGUFValueType, object]
"""One metadata entry to write: key, GGUF value type, value."""

VERSION = 1
KEY_VERSION = PROVENANCE_PREFIX + "version"
KEY_ORIGINAL = PROVENANCE_PREFIX + "original_fingerprint"
KEY_BLOCKS = PROVENANCE_PREFIX + "blocks"
KEY_PERM = PROVENANCE_PREFIX + "perm.blk."


@dataclass
class RepackProvenance:
    """What a repacked file says about itself."""

    original_fingerprint: str
    perms: dict[int, np.ndarray] = field(default_factory=dict)  # block -> perm vs original

    def perm(self, block: int, n_expert: int) -> np.ndarray:
        p = self.perms.get(block)
        return p if p is not None else np.arange(n_expert, dtype=np.int64)

    def to_kv(self) -> list[KvEntry]:
        blocks = sorted(self.perms)
        out: list[KvEntry] = [
            (KEY_VERSION, GGUFValueType.UINT32, VERSION),
            (KEY_ORIGINAL, GGUFValueType.STRING, self.original_fingerprint),
            (KEY_BLOCKS, GGUFValueType.ARRAY, blocks),
        ]
        out += [(f"{KEY_PERM}{b}", GGUFValueType.ARRAY, self.perms[b].tolist()) for b in blocks]
        return out


def read_provenance(model: MoeModel) -> RepackProvenance | None:
    """The provenance recorded in ``model`` (None for a file moepack never permuted).

    Raises ``BadInput`` when the keys are present but inconsistent (unknown key, wrong version,
    a permutation that is not one, blocks that disagree with the per-block keys)."""
    kv = model.provenance()
    if not kv:
        return None
    where = model.shard_paths[0]
    known = {KEY_VERSION, KEY_ORIGINAL, KEY_BLOCKS}
    for key in kv:
        if key not in known and not key.startswith(KEY_PERM):
            raise BadInput(f"unknown provenance key {key!r}", where)
    if kv.get(KEY_VERSION) != VERSION:
        raise BadInput(f"unsupported provenance version {kv.get(KEY_VERSION)!r}", where)
    original = kv.get(KEY_ORIGINAL)
    if not isinstance(original, str) or not original:
        raise BadInput("provenance lacks the original fingerprint", where)
    blocks = kv.get(KEY_BLOCKS)
    if not isinstance(blocks, list):
        raise BadInput("provenance block list is malformed", where)
    perms: dict[int, np.ndarray] = {}
    for key, value in kv.items():
        if not key.startswith(KEY_PERM):
            continue
        suffix = key[len(KEY_PERM) :]
        if not suffix.isdigit() or not isinstance(value, list):
            raise BadInput(f"malformed provenance key {key!r}", where)
        perms[int(suffix)] = np.asarray(value, dtype=np.int64)
    if sorted(perms) != sorted(int(b) for b in blocks):
        raise BadInput("provenance block list disagrees with its permutation keys", where)
    return RepackProvenance(original, perms)


# ----------------------------------------------------------------- serialisation
def _pack_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def pack_kv(key: str, vtype: GGUFValueType, value: object) -> bytes:
    """One GGUF metadata entry. Arrays are of u32 (all moepack's arrays are)."""
    out = _pack_str(key) + struct.pack("<I", int(vtype))
    if vtype == GGUFValueType.UINT32:
        return out + struct.pack("<I", int(value))  # type: ignore[call-overload]
    if vtype == GGUFValueType.STRING:
        return out + _pack_str(str(value))
    if vtype == GGUFValueType.ARRAY:
        items = np.asarray(value, dtype="<u4")
        return out + struct.pack("<IQ", int(GGUFValueType.UINT32), len(items)) + items.tobytes()
    raise ValueError(f"unsupported metadata type {vtype}")
