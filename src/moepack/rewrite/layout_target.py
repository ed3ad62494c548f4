"""The drop-in file a layout describes: ``place``'s blocks turned into a whole GGUF's tensors.

``place`` (``moepack.layout.layout``) is the one truth of where expert slices go: which tensors
a block's matrices become (``fused``: gate and up as one ``ffn_gate_up_exps``), in which order
(``pipeline``: execution order, ahead of the block's other tensors) and which expert takes which
slot (``reorder``). This module lays those tensors out in a file llama.cpp loads: tensor data in
tensor-info order, each tensor on the alignment (``general.alignment``, so with ``--align N``
every tensor starts on N and so does every slice whose size is a multiple of N; a GGUF tensor
cannot pad between its slices). Everything else is copied; expert-axis tensors that are not
matrices (router rows, biases, the selection bias) take the block's permutation where they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from gguf.constants import GGUF_DEFAULT_ALIGNMENT

from ..checkpoint.experts import split_block_name
from ..checkpoint.fused_archs import check_takes_fused
from ..checkpoint.model import MoeModel
from ..errors import BadInput
from ..layout.layout import BlockPlacement, LayoutOptions, LayoutSpec, PlacedTensor, place
from ..layout.plan import Plan
from .target import OutTensor, Part, assign_offsets, is_canonical

MAX_ALIGNMENT = 1 << 30


@dataclass
class ForwardTarget:
    """Every output shard's tensors in order, and what the provenance must record."""

    shards: list[list[OutTensor]]
    alignment: int
    fused_blocks: list[int]
    order: np.ndarray
    perms: dict[int, np.ndarray] = field(default_factory=dict)  # non-identity blocks only
    data_bytes: list[int] = field(default_factory=list)


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


def fused_name(gate_name: str) -> str:
    return gate_name.replace("ffn_gate_exps", "ffn_gate_up_exps", 1)


def info_prefix(model: MoeModel, name: str) -> bytes:
    """A tensor's tensor-info bytes up to (not including) its data offset."""
    t = model.tensors[name]
    raw = model.shards[model.tensor_shard[name]].reader.data
    return bytes(raw[t.info_start : t.info_end - 8])


def forward_target(
    model: MoeModel, spec: LayoutSpec, plan: Plan | None, alignment: int
) -> ForwardTarget:
    """The tensors of ``model`` rewritten as ``spec`` with ``plan``'s permutation; ``alignment``
    0 keeps the model's own."""
    if spec.arrangement == "expert-major":
        raise BadInput(
            f"layout {spec.name!r}: expert-major is a store, not a GGUF llama.cpp loads "
            "(a GGUF tensor holds its experts' slices back to back)"
        )
    if spec.fuse_gate_up:
        check_takes_fused(model.architecture, model.path)
    if alignment:
        check_alignment(alignment)
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
    placement = place(model, spec, LayoutOptions(plan if spec.permute else None, out_align))
    perms = {
        b: np.argsort(bp.slot_of).astype(np.int64)
        for b, bp in placement.blocks.items()
        if not np.array_equal(bp.slot_of, np.arange(bp.n_expert))
    }
    expert_of: dict[str, tuple[int, int]] = {}  # expert-axis tensor -> (block, n_expert)
    for mb in model.blocks:
        for t in mb.tensors:
            expert_of[t.name] = (mb.index, mb.n_expert)
    fused_blocks: list[int] = []
    placed_at: dict[str, tuple[BlockPlacement, PlacedTensor]] = {}
    for bp in placement.blocks.values():
        for pt in bp.tensors:
            for s in pt.sources:
                placed_at[s.name] = (bp, pt)
            if len(pt.sources) > 1:
                fused_blocks.append(bp.block)

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

    def made(bp: BlockPlacement, pt: PlacedTensor) -> OutTensor:
        if len(pt.sources) == 1:
            return copied(pt.sources[0].name)
        gate, up = pt.sources
        ne = (gate.entry.ne[0], gate.entry.ne[1] + up.entry.ne[1], *gate.entry.ne[2:])
        parts = tuple(Part.whole(s.entry, s.shard, bp.n_expert) for s in pt.sources)
        return OutTensor(
            fused_name(gate.name), gate.entry.ggml_type, ne, bp.n_expert, parts, perms.get(bp.block)
        )

    shards: list[list[OutTensor]] = []
    where: dict[str, tuple[int, int]] = {}  # source tensor -> (global output index, half)
    n_out = 0
    started: set[int] = set()  # pipelined blocks already written
    for index, shard in enumerate(model.shards):
        tensors: list[OutTensor] = []
        for entry in shard.tensors:
            hit = placed_at.get(entry.name)
            emit: list[tuple[BlockPlacement, PlacedTensor]] = []
            if spec.arrangement == "pipeline":
                parts = split_block_name(entry.name)
                bi = parts[0] if parts is not None else -1
                bp_here = placement.blocks.get(bi)
                if bp_here is not None and bp_here.shard == index and bi not in started:
                    started.add(bi)
                    emit = [(bp_here, pt) for pt in bp_here.tensors]
            elif hit is not None and hit[1].sources[0].name == entry.name:
                emit = [hit]
            for bp, pt in emit:
                for half, s in enumerate(pt.sources):
                    where[s.name] = (n_out, half)
                tensors.append(made(bp, pt))
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
    data_bytes = [assign_offsets(ts, out_align) for ts in shards]
    return ForwardTarget(shards, out_align, sorted(fused_blocks), order, perms, data_bytes)
