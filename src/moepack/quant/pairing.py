"""Which tensor of the candidate holds each tensor of the reference.

Usually the same name. A fused file holds ``ffn_gate_up_exps`` (per expert: the gate rows,
then the up rows, as llama.cpp splits it) where the other holds ``ffn_gate_exps`` and
``ffn_up_exps``; each half of the fused tensor is paired with its separate tensor, in either
direction. Shapes are compared as llama.cpp's loader reads them, trailing dimensions of 1
dropped (``significant_ne``: llama.cpp's converter writes ``ffn_gate_inp_shexp`` as ``[n]`` in
one file type and ``[n, 1]`` in another, and both load as ``[n]``). Anything else that differs
means two different models: the first such tensor is named.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint.experts import significant_ne
from ..checkpoint.gguf_file import TensorEntry
from ..checkpoint.model import MoeModel
from ..errors import BadInput

FUSED, HALVES = ".ffn_gate_up_exps.", (".ffn_gate_exps.", ".ffn_up_exps.")


@dataclass(frozen=True)
class TensorPair:
    """``name`` (the separate tensor's name when one side is fused) is measured from
    ``ref_name`` in the reference and ``cand_name`` in the candidate; a ``*_half`` of 0 or 1 is
    the gate or up half of each expert slice of a fused tensor."""

    name: str
    ref_name: str
    cand_name: str
    ref_half: int | None = None
    cand_half: int | None = None


def fused_of(name: str) -> tuple[str, int] | None:
    """``blk.3.ffn_up_exps.weight`` -> (``blk.3.ffn_gate_up_exps.weight``, 1)."""
    for half, token in enumerate(HALVES):
        if token in name:
            return name.replace(token, FUSED), half
    return None


def _halved(ne: tuple[int, ...]) -> tuple[int, ...] | None:
    ne = significant_ne(ne)
    if len(ne) < 2 or ne[1] % 2:
        return None
    return (ne[0], ne[1] // 2, *ne[2:])


def same_shape(a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> bool:
    """Equal as llama.cpp reads shapes (trailing dimensions of 1 are no dimensions)."""
    return a is not None and b is not None and significant_ne(a) == significant_ne(b)


def _mismatch(ref: MoeModel, cand: MoeModel, what: str) -> BadInput:
    return BadInput(f"not the same model as {ref.path}: {what}", cand.path)


def pair_tensors(ref: MoeModel, cand: MoeModel) -> list[TensorPair]:
    """Every reference tensor's counterpart, in the reference's order; ``BadInput`` naming the
    first tensor missing, extra or of another shape."""
    pairs: list[TensorPair] = []
    for name, t in ref.tensors.items():
        pairs += _pairs_for(ref, cand, name, t)
    used = {p.cand_name for p in pairs}
    for name in cand.tensors:
        if name not in used:
            raise _mismatch(ref, cand, f"tensor {name!r} is extra")
    return pairs


def _pairs_for(ref: MoeModel, cand: MoeModel, name: str, t: TensorEntry) -> list[TensorPair]:
    other = cand.tensors.get(name)
    if other is not None:
        if not same_shape(other.ne, t.ne):
            raise _mismatch(
                ref, cand, f"tensor {name!r} has shape {list(other.ne)}, not {list(t.ne)}"
            )
        return [TensorPair(name, name, name)]
    fused = fused_of(name)
    if fused is not None and fused[0] in cand.tensors:  # candidate fused, reference separate
        if not same_shape(_halved(cand.tensors[fused[0]].ne), t.ne):
            raise _mismatch(ref, cand, f"fused tensor {fused[0]!r} does not hold {name!r}")
        return [TensorPair(name, name, fused[0], cand_half=fused[1])]
    if FUSED in name:  # reference fused, candidate separate
        halves = [name.replace(FUSED, token) for token in HALVES]
        if all(h in cand.tensors for h in halves):
            for h in halves:
                if not same_shape(cand.tensors[h].ne, _halved(t.ne)):
                    raise _mismatch(ref, cand, f"tensor {h!r} is not half of {name!r}")
            return [TensorPair(h, name, h, ref_half=i) for i, h in enumerate(halves)]
    raise _mismatch(ref, cand, f"tensor {name!r} is missing")
