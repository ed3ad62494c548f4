"""The drop-in file a layout describes: ``place``'s blocks turned into a whole GGUF's tensors.

``place`` (``moepack.layout.layout``) is the one truth of where expert slices go: which tensors
a block's matrices become (``fused``: gate and up as one ``ffn_gate_up_exps``), in which order
(``pipeline``: execution order, ahead of the block's other tensors) and which expert takes which
slot (``reorder``). This module lays those tensors out in a file llama.cpp loads: tensor data in
tensor-info order, each tensor on the alignment (``general.alignment``, so with ``--align N``
every tensor starts on N and so does every slice whose size is a multiple of N; a GGUF tensor
cannot pad between its slices). Everything else is copied; expert-axis tensors that are not
matrices (router rows, biases, the selection bias) take the block's permutation where they are.
A split checkpoint keeps its shards, unless a block packed together spans two of them (as
gguf-split by size leaves it) or a shard size is asked for: then the shards are cut anew on
block boundaries (``cut_on_blocks``), and the provenance records the original's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from gguf.constants import GGUF_DEFAULT_ALIGNMENT

from ..checkpoint.experts import split_block_name
from ..checkpoint.fused_archs import check_takes_fused
from ..checkpoint.model import ExpertTensor, MoeModel
from ..errors import BadInput
from ..layout.layout import LayoutSpec, block_groups, slot_order
from ..layout.plan import Plan
from .header import check_recut
from .target import OutTensor, Part, aligned, assign_offsets, is_canonical

MAX_ALIGNMENT = 1 << 30
MAX_SPLIT_SIZE = 1 << 50  # a PiB per shard: past any disk, within every offset's range


@dataclass
class ForwardTarget:
    """Every output shard's tensors in order, and what the provenance must record."""

    shards: list[list[OutTensor]]
    alignment: int
    fused_blocks: list[int]
    order: np.ndarray
    perms: dict[int, np.ndarray] = field(default_factory=dict)  # non-identity blocks only
    data_bytes: list[int] = field(default_factory=list)
    # the original's tensors per shard when the output's shards are cut elsewhere, else None
    original_shards: list[int] | None = None


@dataclass(frozen=True)
class _Block:
    """One MoE block as the output lays it out: its placed groups (``layout.block_groups``),
    which slot each expert takes, and the one shard its expert matrices are in (None: they
    span shards)."""

    index: int
    n_expert: int
    groups: list[list[ExpertTensor]]
    slot_of: np.ndarray
    home: int | None


def check_alignment(alignment: int) -> None:
    if (
        alignment < GGUF_DEFAULT_ALIGNMENT
        or alignment > MAX_ALIGNMENT
        or alignment & (alignment - 1)
    ):
        raise BadInput(
            f"`alignment` {alignment}: must be a power of two from {GGUF_DEFAULT_ALIGNMENT} "
            f"(GGUF's default, what ggml's tensor data needs) to {MAX_ALIGNMENT:,}"
        )


def check_split_max_size(split_max_size: int) -> None:
    if not 0 < split_max_size <= MAX_SPLIT_SIZE:
        raise BadInput(
            f"`split_max_size` {split_max_size:,}: a shard's data is 1 byte to "
            f"{MAX_SPLIT_SIZE:,} bytes"
        )


def fused_name(gate_name: str) -> str:
    return gate_name.replace("ffn_gate_exps", "ffn_gate_up_exps", 1)


def info_prefix(model: MoeModel, name: str) -> bytes:
    """A tensor's tensor-info bytes up to (not including) its data offset."""
    t = model.tensors[name]
    raw = model.shards[model.tensor_shard[name]].reader.data
    return bytes(raw[t.info_start : t.info_end - 8])


def _blocks(model: MoeModel, spec: LayoutSpec, plan: Plan | None) -> dict[int, _Block]:
    """Every MoE block under ``spec`` (what ``layout.place`` computes, without offsets: a
    block whose matrices span shards is placed in the shard the output gives it)."""
    if spec.permute:
        if plan is None:
            raise BadInput(f"layout {spec.name!r} needs a plan (its permutation of the experts)")
        plan.check_against(model)
    if not model.blocks:
        raise BadInput("the model has no MoE blocks to lay out", model.path)
    out = {}
    for b in model.blocks:
        groups = block_groups(model, b, spec)
        homes = {t.shard for g in groups for t in g}
        home = homes.pop() if len(homes) == 1 else None
        out[b.index] = _Block(b.index, b.n_expert, groups, slot_order(b, spec, plan), home)
    return out


def forward_target(
    model: MoeModel,
    spec: LayoutSpec,
    plan: Plan | None,
    alignment: int,
    split_max_size: int | None = None,
) -> ForwardTarget:
    """The tensors of ``model`` rewritten as ``spec`` with ``plan``'s permutation; ``alignment``
    0 keeps the model's own.

    Tensors stay in their shards unless a block that must be packed together (fused,
    pipelined) spans two of them, as splits by size leave it, or ``split_max_size`` asks for
    shards of that many data bytes: then the output's shards are cut anew, on block
    boundaries (a block is never split), each holding at most ``split_max_size`` bytes of
    tensor data (default: the input's largest shard's), one block alone where it is larger."""
    if spec.arrangement == "expert-major":
        raise BadInput(
            f"layout {spec.name!r}: expert-major is a store, not a GGUF llama.cpp loads "
            "(a GGUF tensor holds its experts' slices back to back)"
        )
    if spec.fuse_gate_up:
        check_takes_fused(model.architecture, model.path)
    if alignment:
        check_alignment(alignment)
    if split_max_size is not None:
        check_split_max_size(split_max_size)
    aligns = {s.alignment for s in model.shards}
    if len(aligns) != 1:
        raise BadInput(f"the shards have different alignments {sorted(aligns)}", model.path)
    out_align = alignment or aligns.pop()
    for shard in model.shards:
        if not is_canonical(shard.tensors, shard.alignment, shard.data_offset, shard.size):
            raise BadInput(
                "its tensor data is not laid out as GGUF writers lay it out (in tensor-info "
                "order, each tensor on the alignment, padded at the end), so a rewritten "
                "layout could not be undone byte for byte",
                shard.path,
            )
    blocks = _blocks(model, spec, plan)
    together = spec.arrangement != "file" or spec.fuse_gate_up
    recut = split_max_size is not None or (
        together and any(b.home is None for b in blocks.values())
    )
    perms = {
        b.index: np.argsort(b.slot_of).astype(np.int64)
        for b in blocks.values()
        if not np.array_equal(b.slot_of, np.arange(b.n_expert))
    }
    expert_of: dict[str, tuple[int, int]] = {}  # expert-axis tensor -> (block, n_expert)
    for mb in model.blocks:
        for t in mb.tensors:
            expert_of[t.name] = (mb.index, mb.n_expert)
    fused_blocks: list[int] = []
    placed_at: dict[str, tuple[_Block, list[ExpertTensor]]] = {}
    for b in blocks.values():
        for g in b.groups:
            for s in g:
                placed_at[s.name] = (b, g)
            if len(g) > 1:
                fused_blocks.append(b.index)

    def copied(name: str) -> OutTensor:
        e = model.tensors[name]
        block, n = expert_of.get(name, (-1, 1))
        return OutTensor(
            e.name,
            e.ggml_type,
            e.ne,
            n,
            (Part.whole(e, model.tensor_shard[name], n),),
            perms.get(block) if n > 1 else None,
            info=info_prefix(model, name),
        )

    def made(b: _Block, group: list[ExpertTensor]) -> OutTensor:
        if len(group) == 1:
            return copied(group[0].name)
        gate, up = group
        ne = (gate.entry.ne[0], gate.entry.ne[1] + up.entry.ne[1], *gate.entry.ne[2:])
        parts = tuple(Part.whole(s.entry, s.shard, b.n_expert) for s in group)
        return OutTensor(
            fused_name(gate.name), gate.entry.ggml_type, ne, b.n_expert, parts, perms.get(b.index)
        )

    shards: list[list[OutTensor]] = []
    where: dict[str, tuple[int, int]] = {}  # source tensor -> (global output index, half)
    n_out = 0
    started: set[int] = set()  # pipelined blocks already written
    for index, shard in enumerate(model.shards):
        tensors: list[OutTensor] = []
        for entry in shard.tensors:
            hit = placed_at.get(entry.name)
            emit: list[tuple[_Block, list[ExpertTensor]]] = []
            if spec.arrangement == "pipeline":
                parts = split_block_name(entry.name)
                b_here = blocks.get(parts[0] if parts is not None else -1)
                # a block's matrices go where its first tensor is (in its own shard, unless
                # the shards are cut anew)
                if (
                    b_here is not None
                    and (recut or b_here.home == index)
                    and b_here.index not in started
                ):
                    started.add(b_here.index)
                    emit = [(b_here, g) for g in b_here.groups]
            elif hit is not None and hit[1][0].name == entry.name:
                emit = [hit]
            for b, g in emit:
                for half, s in enumerate(g):
                    where[s.name] = (n_out, half)
                tensors.append(made(b, g))
                n_out += 1
            if hit is None:
                where[entry.name] = (n_out, 0)
                tensors.append(copied(entry.name))
                n_out += 1
        shards.append(tensors)
    order = np.array(
        [2 * where[t.name][0] + where[t.name][1] for s in model.shards for t in s.tensors],
        dtype=np.int64,
    )
    original_shards = None
    if recut:
        limit = split_max_size or max(s.size - s.data_offset for s in model.shards)
        shards = cut_on_blocks([t for ts in shards for t in ts], limit, out_align)
        if len(shards) != len(model.shards) or _moved(model, shards, order):
            original_shards = [len(s.tensors) for s in model.shards]
            if len(shards) != len(model.shards):
                check_recut(model)
    data_bytes = [assign_offsets(ts, out_align) for ts in shards]
    return ForwardTarget(
        shards, out_align, sorted(fused_blocks), order, perms, data_bytes, original_shards
    )


def cut_on_blocks(tensors: list[OutTensor], limit: int, alignment: int) -> list[list[OutTensor]]:
    """``tensors`` (in output order) in shards of at most ``limit`` bytes of tensor data each
    (every tensor padded to ``alignment``, as gguf-split counts), cut only between blocks:
    the tensors of one ``blk.N`` in a row stay together, and a run larger than ``limit`` is a
    shard of its own. Tensors outside blocks may go anywhere."""
    runs: list[list[OutTensor]] = []
    last: int | None = None
    for t in tensors:
        parts = split_block_name(t.name)
        block = parts[0] if parts is not None else None
        if runs and block is not None and block == last:
            runs[-1].append(t)
        else:
            runs.append([t])
        last = block
    out: list[list[OutTensor]] = []
    size = 0
    for run in runs:
        n = sum(aligned(t.n_bytes, alignment) for t in run)
        if out and size + n <= limit:
            out[-1] += run
            size += n
        else:
            out.append(list(run))
            size = n
    return out


def _moved(model: MoeModel, shards: list[list[OutTensor]], order: np.ndarray) -> bool:
    """Whether any original tensor lands in another shard (by number) than it was in."""
    shard_of = [i for i, ts in enumerate(shards) for _ in ts]
    k = 0
    for i, shard in enumerate(model.shards):
        for _ in shard.tensors:
            if shard_of[int(order[k]) // 2] != i:
                return True
            k += 1
    return False
