"""Which tensors carry the expert axis: decided by shape, with names only to break ties.

In every MoE family the expert index is a tensor's outermost ggml dimension, so a tensor is a
candidate when ``ne[-1] == n_expert``. Trailing dimensions of 1 add nothing (ggml pads every
shape to four dimensions with 1s, and llama.cpp's loader accepts a tensor whose extra dimensions
are 1), so they are dropped first: ERNIE-4.5's converter writes ``exp_probs_b.bias`` as
``[n_expert, 1]``, which is the expert axis ``[n_expert]``. Shape alone can coincide (a 128-wide ``attn_q_norm`` in
a 128-expert model, a shared-expert gate whose length equals the expert count), so gguf-py's
own tensor registry settles what it knows:

* a tensor gguf-py names as routed-expert or router (``*_exps``, ``ffn_gate_inp``,
  ``exp_probs_b``) is an expert tensor when its shape agrees, and *ambiguous* when it does not;
* a tensor gguf-py knows as anything else (attention, norms, shared experts ``*_shexp``) is not;
* gguf-py's "chunk experts" (``*_chexps``) have their own group axis: reported, not permuted;
* a name gguf-py does not know whose outermost dimension equals the expert count is reported
  as ambiguous, never silently guessed either way.

An expert tensor's slice must be whole quantisation blocks: a one-dimensional expert axis stored
in a block type (``[n_expert]`` as Q8_0) packs several experts into one block and cannot be
permuted by moving bytes; it is reported, whatever the user declares.

Users can settle ambiguous tensors explicitly (``assume_expert`` / ``assume_not_expert``).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from enum import Enum

from gguf.constants import MODEL_TENSOR, TENSOR_NAMES

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")

_EXPERT_KINDS = {
    MODEL_TENSOR.FFN_GATE_EXP: "gate",
    MODEL_TENSOR.FFN_UP_EXP: "up",
    MODEL_TENSOR.FFN_DOWN_EXP: "down",
    MODEL_TENSOR.FFN_GATE_UP_EXP: "gate_up",
    MODEL_TENSOR.FFN_NORM_EXP: "norm",
    MODEL_TENSOR.FFN_GATE_INP: "router",
    MODEL_TENSOR.FFN_EXP_PROBS_B: "probs_bias",
}
_GROUP_AXIS = {MODEL_TENSOR.FFN_GATE_CHEXP, MODEL_TENSOR.FFN_UP_CHEXP, MODEL_TENSOR.FFN_DOWN_CHEXP}


def _block_base(template: str) -> str | None:
    return template[len("blk.{bid}.") :] if template.startswith("blk.{bid}.") else None


# llama.cpp (0.3.36) tensors newer than gguf-py 0.19: DeepSeek-4's selection bias for media
# input (an expert-axis ``[n_expert]`` bias) and its token -> expert table (values are expert
# indices, no expert axis; see ``expert_index``).
_LLAMA_CPP_EXPERT_BASES = {"exp_probs_b_vl": "probs_bias"}
_LLAMA_CPP_DENSE_BASES = {"ffn_gate_tid2eid"}

_EXPERT_BASES = {_block_base(TENSOR_NAMES[t]): k for t, k in _EXPERT_KINDS.items()}
_EXPERT_BASES.update(_LLAMA_CPP_EXPERT_BASES)
_GROUP_BASES = {_block_base(TENSOR_NAMES[t]) for t in _GROUP_AXIS}
_KNOWN_BASES = (
    (
        {b for t, name in TENSOR_NAMES.items() if (b := _block_base(name)) is not None}
        | _LLAMA_CPP_DENSE_BASES
    )
    - set(_EXPERT_BASES)
    - _GROUP_BASES
)


class Role(Enum):
    EXPERT = "expert"  # carries the expert axis: permuted with the layer
    DENSE = "dense"  # no expert axis
    GROUP_AXIS = "group-axis"  # its own expert-like group axis (e.g. chunk experts)
    AMBIGUOUS = "ambiguous"  # shape and name disagree, or unknown name with an expert-sized axis


@dataclass(frozen=True)
class Classification:
    role: Role
    kind: str  # gate / up / down / gate_up / router / probs_bias / norm / other
    reason: str


def split_block_name(name: str) -> tuple[int, str, str] | None:
    """``blk.3.ffn_up_exps.weight`` -> (3, 'ffn_up_exps', 'weight'); None outside blocks."""
    m = _BLOCK_RE.match(name)
    if not m:
        return None
    rest = m.group(2)
    base, dot, suffix = rest.rpartition(".")
    if not dot:
        base, suffix = rest, ""
    return int(m.group(1)), base, suffix


def named_part_kind(name: str) -> str | None:
    """The expert part a tensor's name says it is (``gate``, ``up``, ``down``, ``gate_up``,
    or ``gate_bias`` and so on for a ``.bias``), None for a name that says no such thing."""
    parts = split_block_name(name)
    if parts is None:
        return None
    kind = _EXPERT_BASES.get(parts[1])
    if kind not in ("gate", "up", "down", "gate_up"):
        return None
    return f"{kind}_bias" if parts[2] == "bias" else kind


def significant_ne(ne: tuple[int, ...]) -> tuple[int, ...]:
    """``ne`` without its trailing dimensions of 1 (``[64, 1]`` -> ``[64]``), as llama.cpp's
    loader reads shapes; at least one dimension is kept."""
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return tuple(ne[:n])


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def classify(
    name: str,
    ne: tuple[int, ...],
    n_expert: int,
    assume_expert: tuple[str, ...] = (),
    assume_not_expert: tuple[str, ...] = (),
    block_size: int = 1,
) -> Classification:
    """Decide a block tensor's role from its shape, then its name (see the module docstring).

    ``block_size`` is the tensor type's quantisation block (elements), to tell whether one
    expert's slice is whole blocks."""
    parts = split_block_name(name)
    base = parts[1] if parts else name
    ne = significant_ne(ne)
    candidate = len(ne) >= 1 and ne[-1] == n_expert and n_expert > 1
    if candidate and len(ne) == 1 and block_size > 1 and not _matches(name, assume_not_expert):
        return Classification(
            Role.AMBIGUOUS,
            _EXPERT_BASES.get(base, "other"),
            f"its expert axis lies inside quantisation blocks of {block_size} elements "
            f"(one expert's slice is not whole blocks), so it cannot be permuted by moving bytes",
        )
    if _matches(name, assume_not_expert):
        return Classification(Role.DENSE, "other", "declared not an expert tensor by the user")
    if _matches(name, assume_expert):
        if not candidate:
            return Classification(
                Role.AMBIGUOUS,
                "other",
                f"declared an expert tensor, but its outermost dimension {ne[-1] if ne else 0} "
                f"is not the expert count {n_expert}",
            )
        return Classification(Role.EXPERT, _EXPERT_BASES.get(base, "other"), "declared by the user")
    if base in _EXPERT_BASES:
        kind = _EXPERT_BASES[base]
        if candidate:
            return Classification(Role.EXPERT, kind, "outermost dimension is the expert count")
        return Classification(
            Role.AMBIGUOUS,
            kind,
            f"named like an expert tensor but its outermost dimension is "
            f"{ne[-1] if ne else 0}, not the expert count {n_expert}",
        )
    if base in _GROUP_BASES:
        return Classification(
            Role.GROUP_AXIS, "other", "chunk-expert tensor with its own group axis"
        )
    if base in _KNOWN_BASES:
        return Classification(Role.DENSE, "other", "known non-expert tensor")
    if candidate and len(ne) >= 1:
        return Classification(
            Role.AMBIGUOUS,
            "other",
            f"unknown tensor whose outermost dimension equals the expert count {n_expert}",
        )
    return Classification(Role.DENSE, "other", "no expert-sized outermost dimension")
