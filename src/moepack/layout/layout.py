"""Layouts: where every expert slice would sit, by offset arithmetic, without rewriting a byte.

The contract (stable; repack, expert stores and replay code against it):

* A **layout** is a registered plug-in (one module under ``moepack.layout.layouts``, found by
  ``LAYOUTS``) that turns a ``LayoutSpec`` into another one: ``Layout.apply(spec) -> spec``.
  Plug-ins are data transforms; one function, ``place``, does all the arithmetic. A layout name
  may combine plug-ins with ``+`` (``reorder+fused+pipeline``); each is applied in turn from
  ``LayoutSpec()`` (the file as it is) and contradictory ones are refused with a reason.
* ``place(model, layout, options) -> LayoutPlacement`` computes, for every MoE block, each placed
  expert tensor and the offset of every expert's slice in it. Offsets are absolute byte offsets
  in the block's shard: the layout overlays the block's own expert region (starting at its
  first expert matrix), so replaying a layout is reading those offsets from the real file. Only
  the expert *matrices* (``gate``, ``up``, ``down``, ``gate_up``) are placed: routers, norms and
  biases are read whole every token and stay where they are.
* ``PlacedTensor.offsets`` is indexed by the **original expert id** (what a router and a trace
  name), not by slot, so ``BlockPlacement.extents(experts)`` answers "which bytes does this
  token read" for any layout with the same trace.
* ``LayoutOptions``: ``plan`` (a ``Plan`` checked against the model; required by ``reorder``,
  its permutation says which expert takes which slot) and ``alignment`` (bytes; 0 or 1 = none):
  in the ``file`` and ``pipeline`` arrangements each placed tensor starts on a multiple of it and
  its slices follow back to back, as in the GGUF ``repack`` writes (so a slice is aligned when
  its size is a multiple); in ``expert-major`` every slice starts on one, padding between.

Arrangements: ``file`` keeps the checkpoint's tensor order (verbatim offsets when nothing is
fused, aligned or permuted); ``pipeline`` packs a block's expert tensors back to back in
execution order (gate, up, down); ``expert-major`` puts all of one expert's slices next to each
other, expert after expert in slot order. ``fuse_gate_up`` makes gate and up one slice per
expert (gate's bytes then up's), as llama.cpp's ``ffn_gate_up_exps`` stores them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

import numpy as np

from ..checkpoint.model import ExpertTensor, MoeBlock, MoeModel
from ..errors import BadInput
from ..registry import Registry
from .plan import Plan

Arrangement = Literal["file", "pipeline", "expert-major"]
EXECUTION_ORDER = {"gate": 0, "gate_up": 0, "up": 1, "down": 2}
"""The order a MoE feed-forward reads its matrices: gate and up (or both fused), then down."""


@dataclass(frozen=True)
class LayoutSpec:
    """What a (possibly combined) layout does; the default is the file as it is."""

    name: str = "identity"
    permute: bool = False
    fuse_gate_up: bool = False
    arrangement: Arrangement = "file"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "permute": self.permute,
            "fuse_gate_up": self.fuse_gate_up,
            "arrangement": self.arrangement,
        }


class Layout(ABC):
    """A layout plug-in: a name users type and a transform of the spec."""

    name: ClassVar[str]
    summary: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def apply(self, spec: LayoutSpec) -> LayoutSpec:
        """``spec`` with this layout's change; ``BadInput`` (saying why) when it contradicts."""


LAYOUTS: Registry[Layout] = Registry(
    "layout", f"{__package__}.layouts", base=Layout, every_module=True
)
"""Every layout: identity, reorder, pipeline, fused, expert-major."""


def with_arrangement(spec: LayoutSpec, arrangement: Arrangement, name: str) -> LayoutSpec:
    """``spec`` arranged as ``arrangement``; two different arrangements cannot combine."""
    if spec.arrangement not in ("file", arrangement):
        raise BadInput(
            f"layout {name!r} cannot combine with {spec.arrangement!r}: a block's slices are "
            "either grouped by tensor or by expert, not both"
        )
    return replace(spec, arrangement=arrangement)


def resolve_layout(name: str) -> LayoutSpec:
    """The spec of ``name`` (one layout, or several joined by ``+``)."""
    parts = [p.strip() for p in name.split("+")]
    if not parts or any(not p for p in parts):
        raise BadInput(f"layout name {name!r} has an empty part")
    spec = LayoutSpec()
    for part in parts:
        spec = LAYOUTS.get(part).apply(spec)
    return replace(spec, name="+".join(parts))


@dataclass(frozen=True)
class LayoutOptions:
    """Inputs a layout may need: a plan's permutation and a slice alignment."""

    plan: Plan | None = None
    alignment: int = 0


@dataclass(frozen=True)
class PlacedTensor:
    """One expert tensor under a layout: ``sources``' slices of each expert, concatenated."""

    name: str
    kind: str
    sources: tuple[ExpertTensor, ...]
    slice_bytes: int
    offsets: np.ndarray  # int64[n_expert], indexed by original expert id

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "sources": [s.name for s in self.sources],
            "slice_bytes": self.slice_bytes,
        }


@dataclass(frozen=True)
class BlockPlacement:
    """One MoE block under a layout."""

    block: int
    n_expert: int
    shard: int
    tensors: tuple[PlacedTensor, ...]
    slot_of: np.ndarray  # int64[n_expert]: original expert id -> slot

    @property
    def bytes_per_expert(self) -> int:
        return sum(t.slice_bytes for t in self.tensors)

    @property
    def region(self) -> tuple[int, int]:
        """First and one-past-last byte any placed slice occupies."""
        starts = min(int(t.offsets.min()) for t in self.tensors)
        ends = max(int(t.offsets.max()) + t.slice_bytes for t in self.tensors)
        return starts, ends

    def extents(self, experts: np.ndarray) -> np.ndarray:
        """``int64[m, 2]`` (offset, length) of every slice ``experts`` need, sorted by offset."""
        ex = np.asarray(experts, dtype=np.int64).ravel()
        offs = np.concatenate([t.offsets[ex] for t in self.tensors])
        lens = np.concatenate([np.full(len(ex), t.slice_bytes, np.int64) for t in self.tensors])
        order = np.argsort(offs, kind="stable")
        return np.stack([offs[order], lens[order]], axis=1)

    def to_json(self) -> dict[str, Any]:
        start, end = self.region
        return {
            "block": self.block,
            "n_expert": self.n_expert,
            "shard": self.shard,
            "region": [start, end],
            "bytes_per_expert": self.bytes_per_expert,
            "tensors": [t.to_json() for t in self.tensors],
        }


@dataclass(frozen=True)
class LayoutPlacement:
    """Every MoE block of one model under one layout."""

    spec: LayoutSpec
    alignment: int
    blocks: dict[int, BlockPlacement] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name

    def block(self, index: int) -> BlockPlacement:
        return self.blocks[index]

    def to_json(self) -> dict[str, Any]:
        return {
            "layout": self.spec.to_json(),
            "alignment": self.alignment,
            "blocks": [b.to_json() for b in self.blocks.values()],
        }


def place(
    model: MoeModel, layout: str | LayoutSpec, options: LayoutOptions | None = None
) -> LayoutPlacement:
    """Where every expert slice of ``model`` sits under ``layout``; ``BadInput`` when the
    model cannot take it (the message says which block and why)."""
    spec = resolve_layout(layout) if isinstance(layout, str) else layout
    opts = options or LayoutOptions()
    if opts.alignment < 0:
        raise BadInput(f"alignment must be 0 or more bytes, got {opts.alignment}")
    if spec.permute:
        if opts.plan is None:
            raise BadInput(f"layout {spec.name!r} needs a plan (its permutation of the experts)")
        opts.plan.check_against(model)
    if not model.blocks:
        raise BadInput("the model has no MoE blocks to lay out", model.path)
    blocks = {b.index: _place_block(model, b, spec, opts) for b in model.blocks}
    return LayoutPlacement(spec, opts.alignment, blocks)


def _align(x: int, a: int) -> int:
    return x if a <= 1 else -(-x // a) * a


def slot_order(block: MoeBlock, spec: LayoutSpec, plan: Plan | None) -> np.ndarray:
    """``int64[n_expert]``: the slot each original expert of ``block`` takes under ``spec``
    (``plan``'s permutation when the layout permutes)."""
    perm = plan.perm_for(block.index) if (spec.permute and plan) else None
    if perm is None:
        return np.arange(block.n_expert, dtype=np.int64)
    return np.argsort(perm).astype(np.int64)


def block_groups(model: MoeModel, block: MoeBlock, spec: LayoutSpec) -> list[list[ExpertTensor]]:
    """The block's expert matrices grouped into placed tensors, in placement order (a group
    of two: gate and up fused); ``BadInput`` when the block cannot be laid out so."""
    weights = block.weight_tensors
    if spec.arrangement == "file":
        weights = sorted(weights, key=lambda t: t.entry.offset)
    else:
        weights = sorted(weights, key=lambda t: (EXECUTION_ORDER[t.kind], t.entry.offset))
    if not spec.fuse_gate_up:
        return [[t] for t in weights]
    gates = [t for t in weights if t.kind == "gate"]
    ups = [t for t in weights if t.kind == "up"]
    if any(t.kind == "gate_up" for t in weights) and not gates:
        return [[t] for t in weights]  # already fused in the file
    if len(gates) != 1 or len(ups) != 1:
        raise BadInput(
            f"layout {spec.name!r}: block {block.index} has {len(gates)} gate and {len(ups)} up "
            "expert tensors; fusing needs exactly one of each (a gated feed-forward)",
            model.path,
        )
    gate, up = gates[0], ups[0]
    if gate.slice_bytes != up.slice_bytes or gate.entry.ggml_type != up.entry.ggml_type:
        raise BadInput(
            f"layout {spec.name!r}: block {block.index}'s gate and up differ in type or size "
            f"({gate.entry.ggml_type.name} {gate.slice_bytes} B vs {up.entry.ggml_type.name} "
            f"{up.slice_bytes} B per expert), so they cannot be one slice",
            model.path,
        )
    out: list[list[ExpertTensor]] = []
    for t in weights:
        if t is gate:
            out.append([gate, up])
        elif t is not up:
            out.append([t])
    return out


def _place_block(
    model: MoeModel, block: MoeBlock, spec: LayoutSpec, opts: LayoutOptions
) -> BlockPlacement:
    groups = block_groups(model, block, spec)
    shards = {t.shard for g in groups for t in g}
    if len(shards) != 1 and (spec.arrangement != "file" or spec.fuse_gate_up):
        raise BadInput(
            f"layout {spec.name!r}: block {block.index}'s expert tensors span shards "
            f"{sorted(shards)}; packing them together needs one shard",
            model.path,
        )
    shard = min(shards)
    slot_of = slot_order(block, spec, opts.plan)
    n = block.n_expert
    a = opts.alignment
    verbatim = spec.arrangement == "file" and not spec.fuse_gate_up and a <= 1
    placed: list[tuple[list[ExpertTensor], np.ndarray]] = []
    if verbatim:
        for g in groups:
            t = g[0]
            placed.append((g, t.entry.offset + slot_of * t.slice_bytes))
    else:
        cursor = min(t.entry.offset for g in groups for t in g)
        lengths = [sum(t.slice_bytes for t in g) for g in groups]
        if spec.arrangement == "expert-major":
            slot_offsets = np.zeros((len(groups), n), dtype=np.int64)
            for slot in range(n):
                for gi, length in enumerate(lengths):
                    cursor = _align(cursor, a)
                    slot_offsets[gi, slot] = cursor
                    cursor += length
            placed = [(g, slot_offsets[gi][slot_of]) for gi, g in enumerate(groups)]
        else:
            # A GGUF tensor holds its slices back to back (what repack writes): only a
            # tensor's start takes the alignment; its slices are on it when their size is.
            for g, length in zip(groups, lengths, strict=True):
                cursor = _align(cursor, a)
                placed.append((g, cursor + slot_of * length))
                cursor += n * length
    tensors = tuple(
        PlacedTensor(
            _placed_name(block.index, g),
            "gate_up" if len(g) > 1 else g[0].kind,
            tuple(g),
            sum(t.slice_bytes for t in g),
            offs.astype(np.int64),
        )
        for g, offs in placed
    )
    return BlockPlacement(block.index, n, shard, tensors, slot_of)


def _placed_name(block: int, group: list[ExpertTensor]) -> str:
    if len(group) == 1:
        return group[0].name
    return f"blk.{block}.ffn_gate_up_exps"
