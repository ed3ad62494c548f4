"""The model's metadata against its own tensors, as llama.cpp's loader holds them.

A GGUF's metadata can lie where its tensors cannot: a ``block_count`` of 2³¹ − 1 over a
three-block file, an ``embedding_length`` of 0, an ``expert_count`` that no expert tensor
has. llama.cpp refuses such a file at load (an assert, a "wrong shape" or "missing tensor",
or "wrong array length"), so every figure moepack derived from it (``fit``'s 4096 TiB, a plan
for blocks that do not exist) would describe a model nobody can run. ``check_hparams`` refuses
it first, naming the key that disagrees and what the tensors say. It is called by
``MoeModel``, so every reader of a model file (``inspect``, ``fit``, ``repack``, ``plan``,
``store``…) refuses the same files.

What llama.cpp checks, from ``llama_model::load_hparams`` and ``load_tensors`` of the version
llama-cpp-python 0.3.36 vendors:

* ``block_count`` is read for every architecture; per-layer arrays are sized by it (at most
  ``LLAMA_MAX_LAYERS``, else "n > N_MAX"; an array of another length is "wrong array
  length"), and ``create_tensor`` asks for every block's tensors ("missing tensor") while a
  tensor of a block past the count is never asked for ("wrong number of tensors");
* ``token_embd`` is created as ``{n_embd, n_vocab}`` (``n_vocab`` the tokenizer's token
  count) and every router ``ffn_gate_inp`` as ``{n_embd, n_expert}``;
* ``n_expert <= LLAMA_MAX_EXPERTS``, ``n_expert_used <= n_expert``, ``n_expert_used > 0``
  when there are experts and ``== 0`` when there are none (asserts); the expert tensors'
  outermost dimension is ``n_expert``;
* ``n_embd_head_k = key_length`` (default ``n_embd / n_head``) and ``attn_k`` is
  ``{n_embd, n_embd_head_k * n_head_kv(il)}``, ``attn_v`` likewise with ``value_length``
  (``head_count_kv`` defaults to ``head_count``).

A key the file does not have is not checked here (moepack also reads partial files made for
tests and tools; llama.cpp would ask for it). Routing groups (``expert_group_count``) are
modelled by ``expert_index``, not refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from gguf import Keys

from ..errors import BadInput
from .experts import significant_ne, split_block_name
from .gguf_file import GgufFile, TensorEntry

LLAMA_MAX_LAYERS = 512
LLAMA_MAX_EXPERTS = 512
REFUSED = "llama.cpp refuses the file"
_EXPERT_BASES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps")
_ROUTER = "ffn_gate_inp"
Fail = Callable[[str], BadInput]
_PER_LAYER = (
    Keys.LLM.FEED_FORWARD_LENGTH,
    Keys.Attention.HEAD_COUNT,
    Keys.Attention.HEAD_COUNT_KV,
)


class _Meta:
    """The first shard's metadata for one architecture, keys named as they are written."""

    def __init__(self, first: GgufFile, arch: str) -> None:
        self.first = first
        self.arch = arch

    def key(self, template: str) -> str:
        return template.format(arch=self.arch)

    def has(self, template: str) -> bool:
        return self.key(template) in self.first.kv

    def value(self, template: str) -> int | list[int] | None:
        got = self.first.get_int(self.key(template), allow_list=True)
        return got if isinstance(got, int | list) else None

    def at(self, template: str, block: int, default: int) -> int:
        """A per-layer value: the scalar, or the array's entry for ``block``."""
        v = self.value(template)
        if isinstance(v, list):
            return int(v[block]) if block < len(v) else default
        return default if v is None else int(v)


def check_hparams(
    first: GgufFile, arch: str, tensors: Mapping[str, TensorEntry], path: Path
) -> None:
    """``BadInput`` naming the first metadata key llama.cpp would find at odds with the
    tensors of the file (or with its own bounds)."""
    meta = _Meta(first, arch)
    blocks: dict[int, list[str]] = {}  # block -> the names of its tensors
    for name in tensors:
        parts = split_block_name(name)
        if parts is not None:
            blocks.setdefault(parts[0], []).append(name)

    def fail(problem: str) -> BadInput:
        return BadInput(f"{problem} ({REFUSED})", path)

    n_layer = _check_block_count(meta, blocks, fail)
    _check_arrays(meta, n_layer, fail)
    n_embd = _check_embedding(meta, tensors, fail)
    _check_experts(meta, blocks, tensors, n_embd, fail)
    if n_embd is not None:
        _check_attention(meta, blocks, tensors, n_embd, fail)


def _span(indices: list[int]) -> str:
    lo, hi = min(indices), max(indices)
    return f"blk.{lo}" if lo == hi else f"blk.{lo} to blk.{hi}"


def _check_block_count(meta: _Meta, blocks: dict[int, list[str]], fail: Fail) -> int | None:
    if not meta.has(Keys.LLM.BLOCK_COUNT):
        return None
    key = meta.key(Keys.LLM.BLOCK_COUNT)
    n = meta.value(Keys.LLM.BLOCK_COUNT)
    if not isinstance(n, int):
        raise fail(f"{key} is a list, not a count")
    present = sorted(blocks)
    held = (
        f"the file's tensors are for {len(present)} block(s), {_span(present)}" if present else ""
    )
    if n > LLAMA_MAX_LAYERS:
        raise fail(
            f"{key} is {n:,}, past llama.cpp's {LLAMA_MAX_LAYERS} blocks"
            + (f"; {held}" if held else "")
        )
    if present and present[-1] >= n:
        raise fail(f"{key} is {n:,} but {held}")
    missing = [b for b in range(n) if b not in blocks]
    if present and missing:
        raise fail(f"{key} is {n:,} but no tensor belongs to block {missing[0]}; {held}")
    return n


def _check_arrays(meta: _Meta, n_layer: int | None, fail: Fail) -> None:
    if n_layer is None:
        return
    for template in _PER_LAYER:
        v = meta.value(template)
        if isinstance(v, list) and len(v) != n_layer:
            raise fail(
                f"{meta.key(template)} has {len(v)} entries for "
                f"{meta.key(Keys.LLM.BLOCK_COUNT)} {n_layer}"
            )


def _check_embedding(meta: _Meta, tensors: Mapping[str, TensorEntry], fail: Fail) -> int | None:
    if not meta.has(Keys.LLM.EMBEDDING_LENGTH):
        return None
    key = meta.key(Keys.LLM.EMBEDDING_LENGTH)
    n_embd = meta.value(Keys.LLM.EMBEDDING_LENGTH)
    if not isinstance(n_embd, int):
        raise fail(f"{key} is a list, not a width")
    embd = tensors.get("token_embd.weight")
    if embd is not None and embd.ne[0] != n_embd:
        raise fail(f"{key} is {n_embd:,} but token_embd.weight is {embd.ne[0]:,} wide {_ne(embd)}")
    if n_embd == 0:
        raise fail(f"{key} is 0")
    tokens = meta.first.kv.get(Keys.Tokenizer.LIST)
    n_vocab = tokens.array_length() if tokens is not None else None
    if embd is not None and n_vocab is not None and len(embd.ne) > 1 and embd.ne[1] != n_vocab:
        raise fail(
            f"{Keys.Tokenizer.LIST} holds {n_vocab:,} tokens but token_embd.weight has "
            f"{embd.ne[1]:,} rows {_ne(embd)}"
        )
    return n_embd


def _check_experts(
    meta: _Meta,
    blocks: dict[int, list[str]],
    tensors: Mapping[str, TensorEntry],
    n_embd: int | None,
    fail: Fail,
) -> None:
    count_key = meta.key(Keys.LLM.EXPERT_COUNT)
    used_key = meta.key(Keys.LLM.EXPERT_USED_COUNT)
    counts = meta.value(Keys.LLM.EXPERT_COUNT)
    for n in counts if isinstance(counts, list) else [counts or 0]:
        if n > LLAMA_MAX_EXPERTS:
            raise fail(f"{count_key} is {n:,}, past llama.cpp's {LLAMA_MAX_EXPERTS} experts")
    used = meta.value(Keys.LLM.EXPERT_USED_COUNT)
    if not counts and isinstance(used, int) and used > 0:
        raise fail(f"{used_key} is {used} but the file has no {count_key}")
    for b in sorted(blocks):
        for name in blocks[b]:
            _b, stem, suffix = split_block_name(name) or (b, "", "")
            if stem not in _EXPERT_BASES and stem != _ROUTER:
                continue
            entry = tensors[name]
            ne = significant_ne(entry.ne)
            n_expert = meta.at(Keys.LLM.EXPERT_COUNT, b, 0)
            router = stem == _ROUTER and suffix == "weight"
            if router and n_embd is not None and entry.ne[0] != n_embd:
                raise fail(
                    f"{meta.key(Keys.LLM.EMBEDDING_LENGTH)} is {n_embd:,} but the router "
                    f"{name} takes {entry.ne[0]:,} inputs {_ne(entry)}"
                )
            axis = ne[-1] if ne else 1
            if axis != n_expert:
                said = f"is {n_expert}" if meta.has(Keys.LLM.EXPERT_COUNT) else "is missing"
                raise fail(f"{count_key} {said} but {name} has {axis} experts {_ne(entry)}")


def _head_widths(meta: _Meta, n_embd: int, n_head: int, which: str) -> set[int]:
    """The head widths of ``attn_{which}`` llama.cpp may ask for: the key (or value) length,
    by default ``n_embd / n_head``, its sliding-window and (queries) latent-attention ones."""
    lengths = {
        "k": (Keys.Attention.KEY_LENGTH, Keys.Attention.KEY_LENGTH_SWA),
        "v": (Keys.Attention.VALUE_LENGTH, Keys.Attention.VALUE_LENGTH_SWA),
        "q": (
            Keys.Attention.KEY_LENGTH,
            Keys.Attention.KEY_LENGTH_SWA,
            Keys.Attention.KEY_LENGTH_MLA,
        ),
    }[which]
    main = meta.value(lengths[0])
    widths = {main} if isinstance(main, int) else set()
    if main is None and n_head:
        widths.add(n_embd // n_head)
    for template in lengths[1:]:
        other = meta.value(template)
        if isinstance(other, int):
            widths.add(other)
    return {w for w in widths if w > 0}


def _check_attention(
    meta: _Meta,
    blocks: dict[int, list[str]],
    tensors: Mapping[str, TensorEntry],
    n_embd: int,
    fail: Fail,
) -> None:
    """Queries are ``n_head`` heads (twice as wide where a gate rides along, as in
    Qwen3-Next), keys and values ``n_head_kv`` heads; a block with attention and no heads
    divides by zero in llama.cpp's shapes."""
    if not meta.has(Keys.Attention.HEAD_COUNT):
        return
    head_key = meta.key(Keys.Attention.HEAD_COUNT)
    kv_key = meta.key(Keys.Attention.HEAD_COUNT_KV)
    n_head0 = meta.at(Keys.Attention.HEAD_COUNT, 0, 0)  # llama.cpp's n_head(): layer 0's
    for which in ("q", "k", "v"):
        widths = _head_widths(meta, n_embd, n_head0, which)
        for b in sorted(blocks):
            entry = tensors.get(f"blk.{b}.attn_{which}.weight")
            if entry is None or len(entry.ne) < 2:
                continue
            n_head = meta.at(Keys.Attention.HEAD_COUNT, b, 0)
            heads = n_head if which == "q" else meta.at(Keys.Attention.HEAD_COUNT_KV, b, n_head)
            key = head_key if which == "q" or not meta.has(Keys.Attention.HEAD_COUNT_KV) else kv_key
            if heads == 0:
                raise fail(f"{key} is 0 for block {b}, which has attention ({entry.name})")
            if not widths:
                continue
            gates = (1, 2) if which == "q" else (1,)
            if entry.ne[1] not in {heads * w * g for w in widths for g in gates}:
                shown = " or ".join(str(w) for w in sorted(widths))
                raise fail(
                    f"{key} is {heads} for block {b}: {heads} heads of {shown} do not make "
                    f"{entry.name}, {entry.ne[1]:,} wide {_ne(entry)}"
                )


def _ne(entry: TensorEntry) -> str:
    return "(shape " + " x ".join(str(d) for d in entry.ne) + ")"
