"""llama.cpp's file types and the type each tensor gets in one: the mix ``llama-quantize``
chooses (``llama_tensor_get_type`` in llama.cpp's ``src/llama-quant.cpp``, as vendored by
llama-cpp-python 0.3.36), restated for the file types synthetic models are written in.

A K-quant file is not one type: ``Q4_K_M`` keeps the output head and the embedding it ties to
in Q6_K, gives Q6_K to the value projections and down projections of the "use more bits"
layers, Q8_0 to the key and value projections of 8-expert models, and falls back to a 32-wide
block type where a row is not a whole number of 256-wide blocks. ``MXFP4_MOE`` (gpt-oss as
published) puts every expert-axis tensor in MXFP4 and the rest in Q8_0. What llama.cpp keeps
in F32 (norms, routers, 1-D tensors, a delta-net's convolution) stays F32.

Only what these rules read of a model is modelled (``MixModel``); the branches for the
ftypes that need an importance matrix, for Falcon and for GLM-5-Next are left out because no
synthetic family writes them. ``tests/checkpoint/test_ftypes_llama.py`` checks the mix and
the bytes against ``llama_model_quantize`` itself.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto

from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

# llama_ftype (llama.h) of each file type written through the mix.
LLAMA_FTYPES = {
    "Q2_K": 10,
    "Q3_K_S": 11,
    "Q3_K_M": 12,
    "Q3_K_L": 13,
    "Q4_K_S": 14,
    "Q4_K_M": 15,
    "Q5_K_S": 16,
    "Q5_K_M": 17,
    "Q6_K": 18,
    "MXFP4_MOE": 38,
}
# The type a file type gives a tensor no rule changes (llama_ftype_get_default_type).
DEFAULT_TYPES = {
    "Q2_K": T.Q2_K,
    "Q3_K_S": T.Q3_K,
    "Q3_K_M": T.Q3_K,
    "Q3_K_L": T.Q3_K,
    "Q4_K_S": T.Q4_K,
    "Q4_K_M": T.Q4_K,
    "Q5_K_S": T.Q5_K,
    "Q5_K_M": T.Q5_K,
    "Q6_K": T.Q6_K,
    "MXFP4_MOE": T.MXFP4,
}
# A row that is not whole blocks of the chosen type takes this one (then F16 if still not).
_FALLBACK = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}
# Names llama.cpp never quantises (besides norms, routers and tensors of fewer than 2 dims).
_KEPT = (
    "_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_tid2eid.weight",
    "altup",
    "laurel",
    "per_layer_model_proj",
    "ssm_conv1d",
    "shortconv.conv.weight",
    "indexer.k_proj.weight",
    "indexer.q_proj.weight",
    "attn_rel_b.weight",
    "time_mix_",
)
_BLOCK = re.compile(r"blk\.(\d+)\.")


class Category(Enum):
    """The broad tensor categories the rules tell apart (``tensor_category``)."""

    TOKEN_EMBD = auto()
    ATTN_Q = auto()
    ATTN_V = auto()
    ATTN_K = auto()
    ATTN_QKV = auto()
    ATTN_KV_B = auto()
    ATTN_OUTPUT = auto()
    FFN_UP = auto()
    FFN_GATE = auto()
    FFN_DOWN = auto()
    OUTPUT = auto()
    OTHER = auto()


# First match wins, in llama.cpp's order (a fused qkv is not a value projection's name).
_BY_NAME = (
    ("attn_qkv.weight", Category.ATTN_QKV),
    ("attn_kv_b.weight", Category.ATTN_KV_B),
    ("attn_v.weight", Category.ATTN_V),
    ("attn_k.weight", Category.ATTN_K),
    ("attn_q.weight", Category.ATTN_Q),
    ("attn_output.weight", Category.ATTN_OUTPUT),
    ("ffn_up", Category.FFN_UP),
    ("ffn_gate", Category.FFN_GATE),
    ("ffn_down", Category.FFN_DOWN),
)
_VALUE_LIKE = frozenset({Category.ATTN_V, Category.ATTN_QKV, Category.ATTN_KV_B})


def category(name: str) -> Category:
    if name == "output.weight":
        return Category.OUTPUT
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return Category.TOKEN_EMBD
    return next((c for part, c in _BY_NAME if part in name), Category.OTHER)


def quantised_by_llama(name: str, shape: Sequence[int]) -> bool:
    """llama.cpp quantises this tensor (``tensor_allows_quantization``, text models)."""
    return (
        len(shape) >= 2
        and name.endswith("weight")
        and not any(part in name for part in _KEPT)
        and name not in ("position_embd.weight", "token_types.weight")
    )


@dataclass(frozen=True)
class MixModel:
    """What the rules read of a model besides its tensor names and shapes."""

    n_layer: int  # block_count, next-token-prediction blocks included
    n_expert: int  # expert_count
    n_gqa: int  # head_count / head_count_kv of the first layer (0 without kv heads)
    llama_70b: bool = False  # llama.cpp's LLM_TYPE_70B (an 80-layer GQA llama)


@dataclass
class _Counters:
    """The quantiser's running state, in the order it visits tensors."""

    tied: bool
    value_projections: int
    value_seen: int = 0
    down_seen: int = 0


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _layer(name: str) -> int:
    m = _BLOCK.match(name)
    return int(m.group(1)) if m else -1


def visiting_order(names: Sequence[str]) -> list[str]:
    """The order llama.cpp's loader keeps tensors in (by layer, then by name), which is the
    order the counters of the rules advance in."""
    return sorted(names, key=lambda n: (_layer(n), n))


def _fits(qtype: T, ncols: int) -> bool:
    return ncols % GGML_QUANT_SIZES[qtype][0] == 0


def _fallback(qtype: T, ncols: int) -> T:
    if _fits(qtype, ncols):
        return qtype
    out = _FALLBACK.get(qtype, qtype)
    return out if _fits(out, ncols) else T.F16


def mix_types(
    ftype: str, model: MixModel, tensors: Sequence[tuple[str, tuple[int, ...]]]
) -> dict[str, T]:
    """The type of every tensor (``name -> type``) in a file of ``ftype`` made from an F32
    model with these tensors (numpy shapes, rows last), as ``llama_model_quantize`` picks it
    without an importance matrix or overrides."""
    if ftype not in DEFAULT_TYPES:
        raise ValueError(f"no llama.cpp type mix for {ftype}")
    shapes = dict(tensors)
    names = visiting_order(list(shapes))
    counters = _Counters(
        tied="output.weight" not in shapes,
        value_projections=sum(category(n) in _VALUE_LIKE for n in names),
    )
    out: dict[str, T] = {}
    for name in names:
        shape = shapes[name]
        if not quantised_by_llama(name, shape):
            out[name] = T.F32
            continue
        chosen = _choose(ftype, name, shape, model, counters)
        out[name] = _fallback(chosen, shape[-1])
    return out


def _choose(ftype: str, name: str, shape: tuple[int, ...], m: MixModel, c: _Counters) -> T:
    """The type before the fallback for rows that are not whole blocks."""
    default = DEFAULT_TYPES[ftype]
    cat = category(name)
    if cat == Category.OUTPUT or (c.tied and cat == Category.TOKEN_EMBD):
        if ftype == "MXFP4_MOE" or not _fits(default, shape[-1]):
            return T.Q8_0
        return T.Q6_K
    if ftype == "MXFP4_MOE":  # expert-axis tensors (ne[2] > 1) MXFP4, the rest Q8_0
        return T.MXFP4 if len(shape) >= 3 and shape[-3] > 1 else T.Q8_0
    if cat in _VALUE_LIKE:
        return _value_projection(ftype, m, c)
    if cat == Category.ATTN_K:
        return T.Q8_0 if m.n_expert == 8 else default
    if cat == Category.FFN_DOWN:
        layer = _layer(name) if m.n_expert > 1 else c.down_seen
        c.down_seen += 1
        return _down_projection(ftype, layer, m.n_layer, default)
    if cat == Category.ATTN_OUTPUT:
        if m.n_expert == 8:
            return T.Q5_K if ftype in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M") else default
        return {"Q2_K": T.Q3_K, "Q3_K_M": T.Q4_K, "Q3_K_L": T.Q5_K}.get(ftype, default)
    return default


def _value_projection(ftype: str, m: MixModel, c: _Counters) -> T:
    """attn_v, a fused attn_qkv or attn_kv_b: more bits early, late and every third layer."""
    i, n = c.value_seen, c.value_projections
    c.value_seen += 1
    out = DEFAULT_TYPES[ftype]
    if ftype == "Q2_K":
        out = T.Q4_K if m.n_gqa >= 4 else T.Q3_K
    elif ftype == "Q3_K_M":
        out = T.Q5_K if i < 2 else T.Q4_K
    elif ftype == "Q3_K_L":
        out = T.Q5_K
    elif ftype in ("Q4_K_M", "Q5_K_M") and _more_bits(i, n):
        out = T.Q6_K
    elif ftype == "Q4_K_S" and i < 4:
        out = T.Q5_K
    if m.llama_70b and out in (T.Q3_K, T.Q4_K):
        out = T.Q5_K
    if m.n_expert == 8:
        out = T.Q8_0
    return out


def _down_projection(ftype: str, i: int, n: int, default: T) -> T:
    """ffn_down, ffn_down_exps and ffn_down_shexp of layer ``i`` of ``n``."""
    if ftype == "Q2_K":
        return T.Q3_K
    if ftype == "Q3_K_M":
        return T.Q5_K if i < n // 16 else T.Q4_K
    if ftype == "Q3_K_L":
        return T.Q5_K
    if ftype == "Q4_K_M":
        return T.Q6_K if _more_bits(i, n) else default
    if ftype == "Q5_K_M" and _more_bits(i, n):
        return T.Q6_K
    if ftype == "Q4_K_S" and i < n // 8:
        return T.Q5_K
    return default
