"""The file a rewrite produces, tensor by tensor: which source bytes make each output tensor.

One description serves the three directions: ``repack`` builds it from a model and a layout
(``dropin.forward_target``) and writes it, ``verify`` builds it from the original and the
candidate's header and compares it, the undo builds it from a repacked file's provenance.

An output tensor is ``n_expert`` slices (1 for a tensor without the expert axis); slot ``s``
is, part after part, bytes ``[start, start + length)`` of expert ``perm[s]``'s slice of each
part's source tensor. A plain copy is one part, the whole tensor; a fused ``gate_up`` is two
parts (gate's slice, then up's); one half of an un-fused tensor is one part, half a slice.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGMLQuantizationType

from ..checkpoint.gguf_file import TensorEntry

Range = tuple[int, int, int, int]  # (source shard, source offset, output offset, length)


@dataclass(frozen=True)
class Part:
    """Per expert, ``length`` bytes from ``start`` within the expert's slice of ``source``."""

    source: TensorEntry
    shard: int  # the source's shard in its model
    n_expert: int  # how many slices the source has (1: the whole tensor is one slice)
    start: int
    length: int

    @property
    def slice_bytes(self) -> int:
        return self.source.n_bytes // self.n_expert

    @staticmethod
    def whole(source: TensorEntry, shard: int, n_expert: int = 1) -> Part:
        return Part(source, shard, n_expert, 0, source.n_bytes // n_expert)


@dataclass
class OutTensor:
    """One tensor of the output file and where its bytes come from."""

    name: str
    ggml_type: GGMLQuantizationType
    ne: tuple[int, ...]
    n_expert: int
    parts: tuple[Part, ...]
    perm: np.ndarray | None = None  # slot -> source expert; None: slot s is expert s
    info: bytes | None = None  # the source's tensor-info bytes up to the offset, when unchanged
    rel_offset: int = 0  # in the output's data section (set by ``assign_offsets``)

    @property
    def slice_bytes(self) -> int:
        return sum(p.length for p in self.parts)

    @property
    def n_bytes(self) -> int:
        return self.slice_bytes * self.n_expert

    def ranges(self, data_offset: int) -> list[Range]:
        """Every copy this tensor needs, in output order, adjacent ones merged."""
        out: list[Range] = []
        dst = data_offset + self.rel_offset
        perm = self.perm if self.perm is not None else range(self.n_expert)
        for e in perm:
            for p in self.parts:
                src = p.source.offset + int(e) * p.slice_bytes + p.start
                last = out[-1] if out else None
                if (
                    last
                    and last[0] == p.shard
                    and last[1] + last[3] == src
                    and last[2] + last[3] == dst
                ):
                    out[-1] = (last[0], last[1], last[2], last[3] + p.length)
                else:
                    out.append((p.shard, src, dst, p.length))
                dst += p.length
        return out

    def tensor_info(self) -> bytes:
        """This tensor's GGUF tensor-info entry (name, dims, type, offset)."""
        if self.info is not None:
            head = self.info
        else:
            name = self.name.encode("utf-8")
            head = struct.pack("<Q", len(name)) + name + struct.pack("<I", len(self.ne))
            head += struct.pack(f"<{len(self.ne)}Q", *self.ne) + struct.pack("<I", self.ggml_type)
        return head + struct.pack("<Q", self.rel_offset)


def aligned(x: int, alignment: int) -> int:
    return -(-x // alignment) * alignment


def assign_offsets(tensors: list[OutTensor], alignment: int) -> int:
    """Place ``tensors`` back to back in order, each on ``alignment``; returns the data length
    including the padding after the last one (what every GGUF writer produces)."""
    pos = 0
    for t in tensors:
        t.rel_offset = aligned(pos, alignment)
        pos = t.rel_offset + t.n_bytes
    return aligned(pos, alignment)


def is_canonical(entries: list[TensorEntry], alignment: int, data_offset: int, size: int) -> bool:
    """Whether a shard's data is laid out as ``assign_offsets`` lays it out (tensor-info order,
    each on the alignment, padded at the end), so rewriting it back reproduces its bytes."""
    pos = 0
    for t in entries:
        if t.rel_offset != aligned(pos, alignment):
            return False
        pos = t.rel_offset + t.n_bytes
    return size == data_offset + aligned(pos, alignment)
