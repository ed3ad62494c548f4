"""The store's index: which expert record sits where, what each part is, and its checksum.

The index is JSON (docs/store.md gives every field). ``StoreIndex.to_json`` writes it and
``decode_index`` reads it back, checking everything a reader will trust: records inside the
data region, aligned and not overlapping, every part inside its record and exactly as long as
its type and shape say, expert ids a permutation of the block's experts. A store that passes
can be read by offset arithmetic alone.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ..checkpoint.experts import named_part_kind, split_block_name
from ..errors import BadInput
from .format import Header

INDEX_FORMAT = "moepack-expert-store"
CHECKSUM = "sha256"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
PART_KINDS = (
    "gate",
    "up",
    "down",
    "gate_up",
    "gate_bias",
    "up_bias",
    "down_bias",
    "gate_up_bias",
)


def part_bytes(ggml_type: int, shape: tuple[int, ...]) -> int | None:
    """Bytes of a slice of ``shape`` (ggml order) stored as ``ggml_type``; None when rows are
    not whole quantisation blocks of that type (or the type is unknown)."""
    try:
        qtype = GGMLQuantizationType(ggml_type)
    except ValueError:
        return None
    block, size = GGML_QUANT_SIZES[qtype]
    if not shape or shape[0] % block:
        return None
    n = 1
    for d in shape:
        n *= d
    return n // block * size


@dataclass(frozen=True)
class StoredPart:
    """One expert matrix slice in the store."""

    kind: str  # "gate", "up", "down" (or "gate_up" for a fused source tensor; "*_bias")
    ggml_type: int  # the part's own quantisation type (per-expert precision may differ)
    offset: int  # absolute byte offset in the store's data file
    size: int  # bytes
    shape: tuple[int, ...]  # the slice's shape in GGUF order (ne), expert axis removed

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name


@dataclass(frozen=True)
class StoredExpert:
    """One expert's record: all its parts, contiguous, starting on the store's alignment."""

    block: int  # the model's block index (blk.N), as a trace's block map names it
    expert: int  # the ORIGINAL expert id (what the router returns)
    offset: int  # start of the expert's record (all its parts contiguous, aligned)
    size: int  # the record's bytes (the parts plus padding up to the next record)
    parts: tuple[StoredPart, ...]
    checksum: str  # sha256 of the parts' bytes, in part order (padding excluded)
    slot: int = 0  # position among the block's records (storage order)

    @property
    def span(self) -> tuple[int, int]:
        """First and one-past-last byte the parts occupy (a read without trailing padding)."""
        last = self.parts[-1]
        return self.parts[0].offset, last.offset + last.size

    @property
    def payload_bytes(self) -> int:
        return sum(p.size for p in self.parts)


@dataclass(frozen=True)
class SourcePart:
    """A block's expert tensor in the source model, one part of every record."""

    kind: str
    tensor: str
    ggml_type: int
    shape: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "tensor": self.tensor,
            "ggml_type": self.ggml_type,
            "type": GGMLQuantizationType(self.ggml_type).name,
            "shape": list(self.shape),
        }


@dataclass(frozen=True)
class BlockIndex:
    """One MoE block's records, in storage order."""

    block: int
    n_expert: int
    sources: tuple[SourcePart, ...]
    experts: tuple[StoredExpert, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "block": self.block,
            "n_expert": self.n_expert,
            "parts": [s.to_json() for s in self.sources],
            "experts": [
                {
                    "expert": e.expert,
                    "slot": e.slot,
                    "offset": e.offset,
                    "size": e.size,
                    "checksum": e.checksum,
                    "parts": [
                        {"ggml_type": p.ggml_type, "offset": p.offset, "size": p.size}
                        for p in e.parts
                    ],
                }
                for e in self.experts
            ],
        }


@dataclass(frozen=True)
class StoreIndex:
    """Everything the index records."""

    fingerprint: str
    model: str
    architecture: str
    alignment: int
    layout: str
    blocks: tuple[BlockIndex, ...]
    plan: dict[str, Any] | None = None
    precision: dict[str, Any] | None = None
    created_by: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "format": INDEX_FORMAT,
            "version": 1,
            "created_by": self.created_by,
            "model": {
                "fingerprint": self.fingerprint,
                "name": self.model,
                "architecture": self.architecture,
            },
            "alignment": self.alignment,
            "checksum": CHECKSUM,
            "layout": self.layout,
            "plan": self.plan,
            "precision": self.precision,
            "blocks": [b.to_json() for b in self.blocks],
        }


class _IndexFields:
    """Field access that turns every surprise into one ``BadInput`` line naming the store."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = path

    def fail(self, message: str) -> BadInput:
        return BadInput(f"store index: {message}", self.path)

    def get(self, obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
        if not isinstance(obj, dict):
            raise self.fail(f"{where} is not an object")
        if key not in obj:
            raise self.fail(f"{where} has no {key!r}")
        value = obj[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            raise self.fail(f"{where}.{key} is {value!r}, not {kinds[0].__name__}")
        if not isinstance(value, kinds):
            raise self.fail(f"{where}.{key} is {type(value).__name__}, not {kinds[0].__name__}")
        return value

    def count(self, obj: Any, key: str, where: str, low: int = 0) -> int:
        value: int = self.get(obj, key, int, where)
        if value < low:
            raise self.fail(f"{where}.{key} is {value}, below {low}")
        return value


def decode_index(doc: Any, header: Header, path: str | os.PathLike[str]) -> StoreIndex:
    """The index in ``doc`` (parsed JSON), checked against ``header`` (see the module doc)."""
    r = _IndexFields(path)
    fmt = r.get(doc, "format", str, "index")
    if fmt != INDEX_FORMAT:
        raise r.fail(f"format is {fmt!r}, expected {INDEX_FORMAT!r}")
    version = r.count(doc, "version", "index")
    if version != 1:
        raise r.fail(f"version {version} is not one this moepack reads (1)")
    model = r.get(doc, "model", dict, "index")
    fingerprint = r.get(model, "fingerprint", str, "model")
    alignment = r.count(doc, "alignment", "index", 1)
    if alignment != header.alignment:
        raise r.fail(f"alignment {alignment} differs from the header's {header.alignment}")
    checksum = r.get(doc, "checksum", str, "index")
    if checksum != CHECKSUM:
        raise r.fail(f"checksum algorithm {checksum!r} is not {CHECKSUM!r}")
    blocks_doc = r.get(doc, "blocks", list, "index")
    if not blocks_doc:
        raise r.fail("holds no MoE blocks")
    blocks = tuple(_decode_block(r, b, i, header) for i, b in enumerate(blocks_doc))
    seen: set[int] = set()
    for b in blocks:
        if b.block in seen:
            raise r.fail(f"block {b.block} appears twice")
        seen.add(b.block)
    _check_no_overlap(r, blocks)
    plan = doc.get("plan")
    precision = doc.get("precision")
    return StoreIndex(
        fingerprint=fingerprint,
        model=str(model.get("name", "")),
        architecture=str(model.get("architecture", "")),
        alignment=alignment,
        layout=str(doc.get("layout", "")),
        blocks=blocks,
        plan=plan if isinstance(plan, dict) else None,
        precision=precision if isinstance(precision, dict) else None,
        created_by=str(doc.get("created_by", "")),
    )


def _decode_block(r: _IndexFields, doc: Any, i: int, header: Header) -> BlockIndex:
    where = f"blocks[{i}]"
    block = r.count(doc, "block", where)
    n_expert = r.count(doc, "n_expert", where, 1)
    sources: list[SourcePart] = []
    for j, p in enumerate(r.get(doc, "parts", list, where)):
        pw = f"block {block} parts[{j}]"
        kind = r.get(p, "kind", str, pw)
        if kind not in PART_KINDS:
            raise r.fail(f"{pw}.kind {kind!r} is not one of {', '.join(PART_KINDS)}")
        shape = tuple(_dims(r, r.get(p, "shape", list, pw), pw))
        gt = r.count(p, "ggml_type", pw)
        if part_bytes(gt, shape) is None:
            raise r.fail(f"{pw}: type {gt} cannot hold a slice of shape {list(shape)}")
        tensor = str(r.get(p, "tensor", str, pw))
        _check_label(r, block, kind, tensor, pw)
        sources.append(SourcePart(kind, tensor, gt, shape))
    if not sources:
        raise r.fail(f"block {block} has no parts")
    experts_doc = r.get(doc, "experts", list, where)
    if len(experts_doc) != n_expert:
        raise r.fail(f"block {block} lists {len(experts_doc)} experts, n_expert is {n_expert}")
    experts = tuple(
        _decode_expert(r, e, block, slot, sources, header) for slot, e in enumerate(experts_doc)
    )
    if sorted(e.expert for e in experts) != list(range(n_expert)):
        raise r.fail(f"block {block}'s expert ids are not each of 0..{n_expert - 1} once")
    return BlockIndex(block, n_expert, tuple(sources), experts)


def _check_label(r: _IndexFields, block: int, kind: str, tensor: str, where: str) -> None:
    """A part's block and kind must be what its source tensor's name says: a reader serves
    block ``b``'s gate from these labels, so an index that swapped them would serve another
    block's, or the up matrix, without a word."""
    parts = split_block_name(tensor)
    if parts is None or parts[0] != block:
        of = "no block" if parts is None else f"block {parts[0]}"
        raise r.fail(f"{where} is tensor {tensor!r}, of {of}, not of block {block}")
    named = named_part_kind(tensor)
    if named is not None and named != kind:
        raise r.fail(f"{where} is labelled {kind!r}, but its tensor {tensor!r} is the {named!r}")


def _dims(r: _IndexFields, dims: list[Any], where: str) -> list[int]:
    if not dims or len(dims) > 4:
        raise r.fail(f"{where}.shape has {len(dims)} dimensions (1 to 4 expected)")
    out = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= 1 << 40:
            raise r.fail(f"{where}.shape holds {d!r}, not a positive dimension")
        out.append(d)
    return out


def _decode_expert(
    r: _IndexFields, doc: Any, block: int, slot: int, sources: list[SourcePart], header: Header
) -> StoredExpert:
    where = f"block {block} experts[{slot}]"
    expert = r.count(doc, "expert", where)
    if r.count(doc, "slot", where) != slot:
        raise r.fail(f"{where}.slot is not {slot} (records are listed in storage order)")
    offset = r.count(doc, "offset", where)
    size = r.count(doc, "size", where, 1)
    a = header.alignment
    if offset % a or size % a:
        raise r.fail(f"{where}: record at {offset} of {size} bytes is not aligned to {a}")
    if offset < header.data_offset or offset + size > header.data_end:
        raise r.fail(
            f"{where}: record [{offset}, {offset + size}) lies outside the data region "
            f"[{header.data_offset}, {header.data_end})"
        )
    checksum = r.get(doc, "checksum", str, where)
    if not _HEX64.match(checksum):
        raise r.fail(f"{where}.checksum is not 64 lower-case hex digits")
    parts_doc = r.get(doc, "parts", list, where)
    if len(parts_doc) != len(sources):
        raise r.fail(f"{where} has {len(parts_doc)} parts, the block has {len(sources)}")
    parts: list[StoredPart] = []
    cursor = offset
    for j, (p, src) in enumerate(zip(parts_doc, sources, strict=True)):
        pw = f"{where} parts[{j}]"
        gt = r.count(p, "ggml_type", pw)
        po = r.count(p, "offset", pw)
        ps = r.count(p, "size", pw, 1)
        want = part_bytes(gt, src.shape)
        if want is None:
            raise r.fail(f"{pw}: type {gt} cannot hold a slice of shape {list(src.shape)}")
        if ps != want:
            raise r.fail(f"{pw}: {ps} bytes, but type {gt} of shape {list(src.shape)} is {want}")
        if po < cursor or po + ps > offset + size:
            raise r.fail(f"{pw}: [{po}, {po + ps}) is outside its record or overlaps a part")
        cursor = po + ps
        parts.append(StoredPart(src.kind, gt, po, ps, src.shape))
    if parts[0].offset != offset:
        raise r.fail(f"{where}: the first part does not start the record")
    return StoredExpert(block, expert, offset, size, tuple(parts), checksum, slot)


def _check_no_overlap(r: _IndexFields, blocks: tuple[BlockIndex, ...]) -> None:
    records = sorted((e.offset, e.size, e.block, e.expert) for b in blocks for e in b.experts)
    for (o1, s1, b1, e1), (o2, _, b2, e2) in zip(records, records[1:], strict=False):
        if o1 + s1 > o2:
            raise r.fail(f"records of block {b1} expert {e1} and block {b2} expert {e2} overlap")
