"""Where every expert record of a store goes, from the ``expert-major`` layout.

The layout (``moepack.layout``: ``place(model, "expert-major", LayoutOptions(plan, alignment))``)
is the one description of an expert-major arrangement: the parts of a record in execution order
(gate, up, down), experts in slot order (the plan's, when one is given), every part on the
alignment. The store lays each block out exactly as the layout places it, rebased to the store's
data region, blocks one after another. Two cases follow the layout's rule without its offsets:
a precision plan that changes an expert's type (its parts change length), and a split checkpoint
whose block spans shards (the layout overlays one shard's region; the store is a new file).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..checkpoint.experts import significant_ne, split_block_name
from ..checkpoint.model import ExpertTensor, MoeBlock, MoeModel
from ..errors import BadInput
from ..layout.layout import EXECUTION_ORDER, BlockPlacement, LayoutOptions, place
from ..layout.plan import Plan
from .format import align_up
from .index import SourcePart, StoredExpert, StoredPart, part_bytes

StoredType = Callable[[int, int, int, tuple[int, ...]], int]
"""(block, original expert, source type, slice shape) -> the type that part is stored as."""


@dataclass(frozen=True)
class PlacedBlock:
    """One block's sources and records (checksums still empty)."""

    block: int
    n_expert: int
    sources: tuple[SourcePart, ...]
    tensors: tuple[ExpertTensor, ...]  # the source tensor of each part, in part order
    records: tuple[StoredExpert, ...]  # in storage (slot) order


@dataclass(frozen=True)
class StorePlacement:
    layout: str
    alignment: int
    data_offset: int
    data_end: int
    blocks: tuple[PlacedBlock, ...]

    @property
    def records(self) -> int:
        return sum(len(b.records) for b in self.blocks)


def slice_shape(t: ExpertTensor) -> tuple[int, ...]:
    """A tensor's per-expert shape in ggml order (the expert axis removed)."""
    return tuple(significant_ne(t.entry.ne)[:-1])


def place_store(
    model: MoeModel,
    plan: Plan | None,
    alignment: int,
    stored_type: StoredType | None = None,
) -> StorePlacement:
    """Every record's offset, from the model's ``expert-major`` placement; ``stored_type``
    (block, original expert, source type, shape) gives a part's type (default: the source's)."""
    layout = "reorder+expert-major" if plan is not None else "expert-major"
    if plan is not None:
        plan.check_against(model)
    if not model.blocks:
        raise BadInput("the model has no MoE blocks to store", model.path)
    for block in model.blocks:
        ambiguous = model.ambiguous_in(block.index)
        if ambiguous:  # a per-expert tensor the store would leave out, or one it should not
            t = ambiguous[0]
            raise BadInput(
                f"block {block.index} has a tensor moepack cannot classify ({t.name}: "
                f"{t.reason}); declare it with `assume_expert` or `assume_not_expert`",
                model.shard_paths[model.tensor_shard[t.name]],
            )
    layout_blocks = _layout_blocks(model, layout, plan, alignment)
    data_offset = alignment  # the header occupies the first aligned unit
    cursor = data_offset
    blocks: list[PlacedBlock] = []
    for block in sorted(model.blocks, key=lambda b: b.index):
        bp = layout_blocks.get(block.index) if layout_blocks else None
        placed = _place_block(model, block, bp, plan, cursor, alignment, stored_type)
        blocks.append(placed)
        cursor = align_up(max(r.offset + r.size for r in placed.records), alignment)
    return StorePlacement(layout, alignment, data_offset, cursor, tuple(blocks))


def _layout_blocks(
    model: MoeModel, layout: str, plan: Plan | None, alignment: int
) -> dict[int, BlockPlacement] | None:
    """The layout's placement of every block, or None for a split checkpoint whose blocks
    span shards: the layout overlays a shard's own region, which such a block does not have,
    while a store is a new file and packs those blocks by the layout's rule instead."""
    if any(len({t.shard for t in b.weight_tensors}) > 1 for b in model.blocks):
        return None
    return place(model, layout, LayoutOptions(plan, alignment)).blocks


def part_kind(t: ExpertTensor) -> str:
    """``gate``, ``up``, ``down`` or ``gate_up`` for a matrix; ``gate_bias`` and so on for the
    per-expert biases some families carry (gpt-oss), which travel with their expert too."""
    parts = split_block_name(t.name)
    return f"{t.kind}_bias" if parts is not None and parts[2] == "bias" else t.kind


def part_order(block: MoeBlock) -> list[ExpertTensor]:
    """A record's parts in the layout's order: execution order (gate, up, down), then file."""
    return sorted(
        block.weight_tensors,
        key=lambda t: (EXECUTION_ORDER[t.kind], t.shard, t.entry.offset),
    )


def _place_block(
    model: MoeModel,
    block: MoeBlock,
    bp: BlockPlacement | None,
    plan: Plan | None,
    base: int,
    alignment: int,
    stored_type: StoredType | None,
) -> PlacedBlock:
    tensors = part_order(block)
    if bp is not None:
        if [t.sources for t in bp.tensors] != [(t,) for t in tensors]:
            raise BadInput(f"block {block.index}: the layout's parts differ", model.path)
        slot_of = bp.slot_of
    else:
        perm = plan.perm_for(block.index) if plan is not None else None
        slot_of = np.argsort(perm) if perm is not None else np.arange(block.n_expert)
    sources = tuple(
        SourcePart(part_kind(t), t.name, int(t.entry.ggml_type), slice_shape(t)) for t in tensors
    )
    n = block.n_expert
    stored_types = [
        [
            stored_type(block.index, e, s.ggml_type, s.shape) if stored_type else s.ggml_type
            for s in sources
        ]
        for e in range(n)
    ]
    as_source = all(
        st == s.ggml_type for row in stored_types for st, s in zip(row, sources, strict=True)
    )
    layout_offsets = bp is not None and as_source
    region_start = bp.region[0] if bp is not None else 0
    records: list[StoredExpert] = []
    cursor = base
    for slot, e in enumerate(np.argsort(slot_of).tolist()):
        parts: list[StoredPart] = []
        for j, src in enumerate(sources):
            gt = stored_types[e][j]
            size = part_bytes(gt, src.shape)
            if size is None:
                raise BadInput(
                    f"block {block.index} expert {e}: type {gt} cannot hold {src.tensor}'s rows "
                    f"of {src.shape[0]} values",
                    model.path,
                )
            if layout_offsets:  # the layout's own offset, rebased to this block's base
                assert bp is not None
                offset = base + int(bp.tensors[j].offsets[e]) - region_start
            else:  # the layout's rule: each part on the alignment, in order
                offset = align_up(cursor, alignment)
            parts.append(StoredPart(src.kind, gt, offset, size, src.shape))
            cursor = offset + size
        start = parts[0].offset
        end = align_up(parts[-1].offset + parts[-1].size, alignment)
        records.append(StoredExpert(block.index, e, start, end - start, tuple(parts), "", slot))
    return PlacedBlock(block.index, n, sources, tuple(tensors), tuple(records))
