"""Which original bytes each tensor of a candidate file must hold, read from the two headers.

A candidate tensor with an original's name must have its type and shape and holds that tensor
(its experts possibly permuted). A ``blk.N.ffn_gate_up_exps.weight`` the original lacks is a
fusion: it must be the original's gate and up of block N side by side (same type, twice the
rows), in an architecture whose llama.cpp loader takes it. Every original tensor must be used
exactly once. The result is ``target``'s description, so verify compares what repack writes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint.fused_archs import takes_fused_gate_up
from ..checkpoint.gguf_file import TensorEntry
from ..checkpoint.model import MoeBlock, MoeModel
from .target import OutTensor, Part

FUSED_SUFFIX = ".ffn_gate_up_exps.weight"


class PairingError(Exception):
    """The candidate's tensors are not a rewrite of the original's."""

    def __init__(self, message: str, tensor: str, shard: int) -> None:
        super().__init__(message)
        self.message = message
        self.tensor = tensor
        self.shard = shard


@dataclass
class Paired:
    """One candidate tensor and the original bytes it must hold (``tensor.perm`` unset)."""

    entry: TensorEntry
    shard: int
    tensor: OutTensor
    block: int | None  # the MoE block whose permutation it takes
    fused: bool  # a fusion of the original's gate and up


def _describe(t: TensorEntry) -> str:
    return f"{t.type_name}{list(t.ne)}"


def pair_tensors(orig: MoeModel, rep: MoeModel) -> list[list[Paired]]:
    """Per candidate shard, its tensors in tensor-info order, paired with the original."""
    block_of = {t.name: b for b in orig.blocks for t in b.tensors}
    used: set[str] = set()
    out: list[list[Paired]] = []
    for si, shard in enumerate(rep.shards):
        row: list[Paired] = []
        for t in shard.tensors:
            ot = orig.tensors.get(t.name)
            if ot is not None:
                if (ot.ggml_type, ot.ne) != (t.ggml_type, t.ne):
                    raise PairingError(
                        f"tensor {t.name!r} is {_describe(t)}, original is {_describe(ot)}",
                        t.name,
                        si,
                    )
                block = block_of.get(t.name)
                n = block.n_expert if block is not None else 1
                part = Part.whole(ot, orig.tensor_shard[t.name], n)
                desc = OutTensor(t.name, t.ggml_type, t.ne, n, (part,))
                row.append(Paired(t, si, desc, block.index if block else None, False))
                used.add(t.name)
                continue
            if not t.name.endswith(FUSED_SUFFIX):
                raise PairingError(f"extra tensor {t.name!r}", t.name, si)
            row.append(_fused(orig, t, si, block_of))
            used.update(p.source.name for p in row[-1].tensor.parts)
        out.append(row)
    missing = set(orig.tensors) - used
    if missing:
        name = min(missing, key=lambda n: (orig.tensor_shard[n], orig.tensors[n].offset))
        raise PairingError(f"tensor {name!r} is missing", name, 0)
    return out


def _fused(orig: MoeModel, t: TensorEntry, si: int, block_of: dict[str, MoeBlock]) -> Paired:
    stem = t.name[: -len(FUSED_SUFFIX)]
    gate, up = (orig.tensors.get(f"{stem}.ffn_{k}_exps.weight") for k in ("gate", "up"))
    if gate is None or up is None or gate.name not in block_of or up.name not in block_of:
        raise PairingError(
            f"extra tensor {t.name!r} (the original has no expert gate and up to fuse)", t.name, si
        )
    if not takes_fused_gate_up(orig.architecture):
        raise PairingError(
            f"tensor {t.name!r}: llama.cpp's {orig.architecture} loader does not take a fused "
            "gate_up (it would not load)",
            t.name,
            si,
        )
    want = (gate.ne[0], gate.ne[1] + up.ne[1], *gate.ne[2:])
    if (gate.ggml_type, gate.ne) != (up.ggml_type, up.ne) or (t.ggml_type, t.ne) != (
        gate.ggml_type,
        want,
    ):
        raise PairingError(
            f"tensor {t.name!r} is {_describe(t)}; fusing {_describe(gate)} gate and "
            f"{_describe(up)} up makes {gate.type_name}{list(want)}",
            t.name,
            si,
        )
    block = block_of[gate.name]
    n = block.n_expert
    parts = tuple(Part.whole(s, orig.tensor_shard[s.name], n) for s in (gate, up))
    return Paired(t, si, OutTensor(t.name, t.ggml_type, t.ne, n, parts), block.index, True)
