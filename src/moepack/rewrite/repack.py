"""``repack``: a drop-in GGUF with each MoE block's experts in a new order, and optionally a new
layout (``fused``, ``pipeline``, an alignment: see ``layout_target``).

A pure reorder keeps the same metadata, tensor names, types, shapes and data offsets; in each planned block every
expert-axis tensor (expert matrices, fused gate_up, biases, the router's rows, the selection
bias) is permuted with the block's one permutation, every other tensor is copied byte for byte.
The permutation is recorded in the header (see ``provenance``) unless ``keep_header`` asks for the
original header bytes. Streams through the kernel with bounded memory; all outputs appear
atomically; split checkpoints in give split checkpoints out, cut anew on block boundaries where
a layout packs a block the input's shards split (``split_max_size``: shards of that many data
bytes, like gguf-split's). A layout change writes the tensors ``layout_target`` describes, at
offsets packed in tensor-info order, and records in the provenance what undoing it needs
(``undo`` returns the original byte for byte, shard for shard).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..binding import FINGERPRINT, basis, shape_only_warning
from ..checkpoint.gguf_file import GgufFile
from ..checkpoint.model import MoeModel
from ..checkpoint.provenance import KvEntry, RepackProvenance, pack_kv, read_provenance
from ..errors import BadInput
from ..layout.layout import LayoutSpec, resolve_layout
from ..layout.plan import LayerPlan, Plan
from ..progress import NULL_PROGRESS, ProgressSink
from ..storage.copy import RangeCopier, copy_ranges, pwrite_all, write_zeros
from ..storage.writeback import Writeback
from .header import assemble_header, padded, rebuild_header, shard_metadata
from .layout_target import ForwardTarget, forward_target
from .write_target import write_outputs, write_target_shard


@dataclass
class RepackResult:
    outputs: list[Path]
    blocks_permuted: list[int]
    tensors_permuted: int
    tensors_copied: int
    bytes_written: int
    provenance_recorded: bool
    seconds: float
    notes: list[str] = field(default_factory=list)
    # "fingerprint" when the plan named the model it was made for, "shape" when it named none
    plan_binding: str = FINGERPRINT
    warnings: list[str] = field(default_factory=list)
    layout: str = "reorder"
    alignment: int = 0  # of the output's data (general.alignment)
    blocks_fused: list[int] = field(default_factory=list)


def _composed(
    model: MoeModel, plan: Plan | None, current: RepackProvenance | None
) -> RepackProvenance:
    """RepackProvenance of the output: the plan applied on top of what the input already carries
    (a layout the input records is kept: permuting does not move tensors)."""
    original = current.original_fingerprint if current else model.fingerprint
    perms: dict[int, np.ndarray] = {}
    for block in model.blocks:
        base = current.perm(block.index, block.n_expert) if current else np.arange(block.n_expert)
        step = plan.perm_for(block.index) if plan is not None else None
        perm = base[step] if step is not None else base
        if not np.array_equal(perm, np.arange(block.n_expert)):
            perms[block.index] = perm.astype(np.int64)
    if current is None:
        return RepackProvenance(original, perms)
    return RepackProvenance(
        original, perms, current.fused, current.alignment, current.order, current.shards
    )


def resolve_repack_layout(layout: str | None, plan: Plan | None) -> LayoutSpec:
    """The layout a repack writes: ``layout`` (default ``reorder`` with a plan, else
    ``identity``), with ``reorder`` added when a plan is given."""
    spec = resolve_layout(layout or ("reorder" if plan is not None else "identity"))
    if plan is not None and not spec.permute:
        spec = resolve_layout(f"{spec.name}+reorder")
    return spec


def changes_layout(spec: LayoutSpec, model: MoeModel, alignment: int) -> bool:
    """Whether writing ``spec`` moves tensors, not only expert slices within them."""
    moved = alignment > 0 and any(s.alignment != alignment for s in model.shards)
    return spec.fuse_gate_up or spec.arrangement != "file" or moved


def undo_plan(model_path: str | os.PathLike[str]) -> Plan:
    """The plan that returns a repacked file to its original order, from its provenance."""
    with MoeModel(model_path) as model:
        prov = read_provenance(model)
        if prov is None:
            raise BadInput("has no moepack provenance: nothing to undo", model.path)
        layers = [
            LayerPlan(b, np.argsort(p).astype(np.int64)) for b, p in sorted(prov.perms.items())
        ]
        return Plan(
            layers, model.fingerprint, str(model.path), source="undo of the recorded repack"
        )


def repack(
    model_path: str | os.PathLike[str],
    plan: Plan | None,
    out: str | os.PathLike[str],
    *,
    keep_header: bool = False,
    plan_path: str | os.PathLike[str] | None = None,
    progress: ProgressSink = NULL_PROGRESS,
    assume_expert: tuple[str, ...] = (),
    assume_not_expert: tuple[str, ...] = (),
    layout: str | None = None,
    alignment: int = 0,
    split_max_size: int | None = None,
) -> RepackResult:
    """Write ``model_path`` with ``plan`` applied to ``out`` (see the module docstring), laid out
    as ``layout`` (``reorder``, ``fused``, ``pipeline`` and their ``+`` combinations) with every
    tensor on ``alignment`` bytes (0: the model's own), in shards of at most
    ``split_max_size`` bytes of tensor data cut on block boundaries (None: the input's shards,
    cut anew only where a block the layout packs spans two).

    ``assume_expert`` / ``assume_not_expert`` settle tensors the detector reports as ambiguous."""
    t0 = time.perf_counter()
    spec = resolve_repack_layout(layout, plan)
    with MoeModel(model_path, assume_expert, assume_not_expert) as model:
        if plan is not None:
            plan.check_against(model, plan_path)
        warnings = []
        if plan is not None and plan.model_fingerprint is None:
            warnings.append(shape_only_warning("plan", plan_path, model.path))
        layers = plan.layers if plan is not None else []
        active = {lp.block: lp.perm for lp in layers if not lp.is_identity}
        for b in active:
            ambiguous = model.ambiguous_in(b)
            if ambiguous:
                raise BadInput(
                    f"block {b} has a tensor moepack cannot classify ({ambiguous[0].name}: "
                    f"{ambiguous[0].reason}); declare it with `assume_expert` or `assume_not_expert`",
                    model.shard_paths[model.tensor_shard[ambiguous[0].name]],
                )
        for b, perm in active.items():
            why = model.block(b).violation(perm)
            if why is not None:
                raise BadInput(
                    f"block {b}: the plan would change what llama.cpp computes: {why}",
                    plan_path or model.path,
                )
        current = read_provenance(model)
        notes: list[str] = []
        if changes_layout(spec, model, alignment) or split_max_size is not None:
            if keep_header:
                raise BadInput(
                    "`keep_header` cannot keep a header whose tensors change", model.path
                )
            if current is not None and current.changes_layout:
                raise BadInput(
                    "is already a layout rewrite; undo it (repack `undo`) and rewrite the "
                    "original with the whole layout",
                    model.path,
                )
            return _repack_layout(
                model,
                spec,
                plan,
                (alignment, split_max_size),
                out,
                plan_path,
                current,
                progress,
                t0,
                warnings,
            )
        if keep_header:
            if current is not None and active:
                raise BadInput(
                    "`keep_header` would keep provenance that no longer describes the file; "
                    "repack without it",
                    model.path,
                )
            new_kv = None
        else:
            prov = _composed(model, plan, current)
            new_kv = prov.to_kv() if prov.perms or prov.changes_layout else []
            if not new_kv:
                notes.append(
                    "the composed permutation is the identity: no provenance keys are written"
                    + (" (the input's were removed)" if current is not None else "")
                )
        perm_of: dict[str, np.ndarray] = {}
        for block in model.blocks:
            if block.index in active:
                for t in block.tensors:
                    perm_of[t.name] = active[block.index]
        dests, written = write_outputs(
            model,
            out,
            _inputs(model, plan_path),
            lambda i, fd: _write_permuted_shard(model.shards[i], fd, new_kv, perm_of, progress),
            need_bytes=model.file_bytes,
            what="the repacked model",
            label=f"repacking {model.path.name}",
            progress=progress,
        )
        n_perm = len(perm_of)
        return RepackResult(
            outputs=dests,
            blocks_permuted=sorted(active),
            tensors_permuted=n_perm,
            tensors_copied=len(model.tensors) - n_perm,
            bytes_written=written,
            provenance_recorded=bool(new_kv),
            seconds=time.perf_counter() - t0,
            notes=notes,
            plan_binding=basis(plan.model_fingerprint if plan is not None else model.fingerprint),
            warnings=warnings,
            layout=spec.name,
            alignment=model.shards[0].alignment,
        )


def _repack_layout(
    model: MoeModel,
    spec: LayoutSpec,
    plan: Plan | None,
    sizes: tuple[int, int | None],
    out: str | os.PathLike[str],
    plan_path: str | os.PathLike[str] | None,
    current: RepackProvenance | None,
    progress: ProgressSink,
    t0: float,
    warnings: list[str],
) -> RepackResult:
    """A repack that moves tensors: write what ``forward_target`` describes (``sizes``: the
    alignment and the shards' data size asked for)."""
    alignment, split_max_size = sizes
    target = forward_target(model, spec, plan, alignment, split_max_size)
    prov = _composed(model, plan, current)
    first = model.shards[0]
    record: int | None = None
    if target.alignment != first.alignment:
        record = int(first.get_int("general.alignment", 0) or 0)
    prov = RepackProvenance(
        prov.original_fingerprint,
        prov.perms,
        target.fused_blocks,
        record,
        target.order,
        target.original_shards,
    )
    headers = _headers(model, target, prov.to_kv())
    dests, written = write_outputs(
        model,
        out,
        _inputs(model, plan_path),
        lambda i, fd: write_target_shard(
            model.shard_paths,
            fd,
            headers[i],
            target.shards[i],
            target.alignment,
            target.data_bytes[i],
            progress,
        ),
        need_bytes=sum(target.data_bytes) + sum(len(h) for h in headers),
        what="the repacked model",
        label=f"repacking {model.path.name}",
        progress=progress,
        shards=len(target.shards),
    )
    permuted = [t for ts in target.shards for t in ts if t.perm is not None]
    n_out = sum(len(ts) for ts in target.shards)
    notes = []
    if alignment:
        experts = [t for ts in target.shards for t in ts if t.name.endswith("_exps.weight")]
        odd = [t for t in experts if t.slice_bytes % alignment]
        if odd:
            notes.append(
                f"{len(odd)} of {len(experts)} expert matrices have slices that are not a "
                f"multiple of {alignment} bytes (e.g. {odd[0].name}: {odd[0].slice_bytes:,}): "
                "they start on the boundary, their later slices do not (a GGUF tensor cannot "
                "pad between slices)"
            )
    return RepackResult(
        outputs=dests,
        blocks_permuted=sorted(target.perms),
        tensors_permuted=len(permuted),
        tensors_copied=n_out - len(permuted),
        bytes_written=written,
        provenance_recorded=True,
        seconds=time.perf_counter() - t0,
        notes=notes,
        plan_binding=basis(plan.model_fingerprint if plan is not None else model.fingerprint),
        warnings=warnings,
        layout=spec.name,
        alignment=target.alignment,
        blocks_fused=target.fused_blocks,
    )


def _headers(model: MoeModel, target: ForwardTarget, provenance: list[KvEntry]) -> list[bytes]:
    """Each output shard's header: the input's metadata (``shard_metadata``: alignment and
    split keys as the output has them), the provenance, and the new tensor infos."""
    n_out = sum(len(ts) for ts in target.shards)
    count = len(target.shards)
    out = []
    for i, tensors in enumerate(target.shards):
        kvs = shard_metadata(model, i, count, n_out, target.alignment)
        raws = [raw for _, raw in kvs] + [pack_kv(k, t, v) for k, t, v in provenance]
        like = model.shards[min(i, len(model.shards) - 1)]  # its GGUF magic and version
        out.append(assemble_header(like, raws, [t.tensor_info() for t in tensors]))
    return out


def _inputs(model: MoeModel, plan_path: str | os.PathLike[str] | None) -> list[Path]:
    """What a repack reads, so that no output replaces it: the shards and the plan file."""
    return list(model.shard_paths) + ([Path(plan_path)] if plan_path else [])


def _write_permuted_shard(
    shard: GgufFile,
    dst_fd: int,
    new_kv: list[KvEntry] | None,
    perm_of: dict[str, np.ndarray],
    progress: ProgressSink,
) -> int:
    """Write ``shard`` to ``dst_fd`` with the expert slices of the tensors in ``perm_of``
    permuted and every tensor at its own offset (the header kept, or rebuilt with ``new_kv``);
    returns the file length."""
    header = shard.header_bytes() if new_kv is None else rebuild_header(shard, new_kv)
    data_start = padded(len(header), shard.alignment)
    pwrite_all(dst_fd, header, 0)
    write_zeros(dst_fd, len(header), data_start - len(header))
    src_fd = os.open(shard.path, os.O_RDONLY)
    try:
        ranges: list[tuple[int, int, int]] = []
        pos = 0  # relative to the data section
        for t in sorted(shard.tensors, key=lambda t: t.offset):
            write_zeros(dst_fd, data_start + pos, t.rel_offset - pos)
            dst = data_start + t.rel_offset
            perm = perm_of.get(t.name)
            if perm is None:
                ranges.append((t.offset, dst, t.n_bytes))
            else:
                step = t.n_bytes // len(perm)
                ranges += [
                    (t.offset + int(e) * step, dst + slot * step, step)
                    for slot, e in enumerate(perm)
                ]
            pos = t.rel_offset + t.n_bytes
        with Writeback(dst_fd) as writeback:
            copy_ranges(RangeCopier(src_fd, dst_fd), ranges, progress.advance, writeback)
        tail = min(shard.size - shard.data_end, (-pos) % shard.alignment)
        write_zeros(dst_fd, data_start + pos, tail)
        return data_start + pos + tail
    finally:
        os.close(src_fd)
