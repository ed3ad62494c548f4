"""``repack``: a drop-in GGUF with each MoE block's experts in a new order.

Same metadata, tensor names, types, shapes and data offsets; in each planned block every
expert-axis tensor (expert matrices, fused gate_up, biases, the router's rows, the selection
bias) is permuted with the block's one permutation, every other tensor is copied byte for byte.
The permutation is recorded in the header (see ``provenance``) unless ``keep_header`` asks for the
original header bytes. Streams through the kernel with bounded memory; all outputs appear
atomically; split checkpoints in give split checkpoints out.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..binding import FINGERPRINT, basis, shape_only_warning
from ..checkpoint.gguf_file import GgufFile
from ..checkpoint.model import SPLIT_RE, MoeModel
from ..errors import BadInput
from ..filekinds import GGUF, check_output_kind
from ..layout.plan import LayerPlan, Plan
from ..progress import NULL_PROGRESS, ProgressSink
from ..safeio import AtomicOutputs, check_destination, check_free_space, describe_os_error
from .copy import RangeCopier, copy_ranges, pwrite_all, write_zeros
from .header import padded, rebuild_header
from .provenance import KvEntry, RepackProvenance, read_provenance
from .writeback import Writeback


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


def output_paths(model: MoeModel, out: str | os.PathLike[str]) -> list[Path]:
    """Where each shard goes: ``out`` itself, or ``STEM-0000i-of-0000N.gguf`` beside it."""
    dest = Path(out)
    n = len(model.shards)
    if n == 1:
        return [dest]
    m = SPLIT_RE.match(dest.name)
    stem = m.group("stem") if m else (dest.name[:-5] if dest.name.endswith(".gguf") else dest.name)
    return [dest.with_name(f"{stem}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def _composed(model: MoeModel, plan: Plan, current: RepackProvenance | None) -> RepackProvenance:
    """RepackProvenance of the output: the plan applied on top of what the input already carries."""
    original = current.original_fingerprint if current else model.fingerprint
    perms: dict[int, np.ndarray] = {}
    for block in model.blocks:
        base = current.perm(block.index, block.n_expert) if current else np.arange(block.n_expert)
        step = plan.perm_for(block.index)
        perm = base[step] if step is not None else base
        if not np.array_equal(perm, np.arange(block.n_expert)):
            perms[block.index] = perm.astype(np.int64)
    return RepackProvenance(original, perms)


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
    plan: Plan,
    out: str | os.PathLike[str],
    keep_header: bool = False,
    plan_path: str | os.PathLike[str] | None = None,
    progress: ProgressSink = NULL_PROGRESS,
    assume_expert: tuple[str, ...] = (),
    assume_not_expert: tuple[str, ...] = (),
) -> RepackResult:
    """Write ``model_path`` with ``plan`` applied to ``out`` (see the module docstring).

    ``assume_expert`` / ``assume_not_expert`` settle tensors the detector reports as ambiguous."""
    t0 = time.perf_counter()
    with MoeModel(model_path, assume_expert, assume_not_expert) as model:
        plan.check_against(model, plan_path)
        warnings = []
        if plan.model_fingerprint is None:
            warnings.append(shape_only_warning("plan", plan_path, model.path))
        active = {lp.block: lp.perm for lp in plan.layers if not lp.is_identity}
        for b in active:
            ambiguous = model.ambiguous_in(b)
            if ambiguous:
                raise BadInput(
                    f"block {b} has a tensor moepack cannot classify ({ambiguous[0].name}: "
                    f"{ambiguous[0].reason}); declare it with --assume-expert or --assume-not-expert",
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
        if keep_header:
            if current is not None and active:
                raise BadInput(
                    "--keep-header would keep provenance that no longer describes the file; "
                    "repack without it",
                    model.path,
                )
            new_kv = None
        else:
            prov = _composed(model, plan, current)
            new_kv = prov.to_kv() if prov.perms else []
            if not prov.perms:
                notes.append(
                    "the composed permutation is the identity: no provenance keys are written"
                    + (" (the input's were removed)" if current is not None else "")
                )
        dests = output_paths(model, out)
        inputs = list(model.shard_paths) + ([Path(plan_path)] if plan_path else [])
        for d in dests:
            check_destination(d, inputs)
            check_output_kind(d, GGUF)
        check_free_space(dests[0].parent, model.file_bytes + 1024 * 1024, "the repacked model")

        perm_of: dict[str, np.ndarray] = {}
        for block in model.blocks:
            if block.index in active:
                for t in block.tensors:
                    perm_of[t.name] = active[block.index]
        total = sum(t.n_bytes for t in model.tensors.values())
        progress.start(f"repacking {model.path.name}", total)
        written = 0
        try:
            with AtomicOutputs(inputs) as outs:
                for shard, dest in zip(model.shards, dests, strict=True):
                    fh = outs.open(dest)
                    written += _write_shard(shard, fh.fileno(), new_kv, perm_of, progress)
        except OSError as e:
            raise describe_os_error(e, dests[0]) from None
        finally:
            progress.finish()
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
            plan_binding=basis(plan.model_fingerprint),
            warnings=warnings,
        )


def _write_shard(
    shard: GgufFile,
    dst_fd: int,
    new_kv: list[KvEntry] | None,
    perm_of: dict[str, np.ndarray],
    progress: ProgressSink,
) -> int:
    """Write one shard's bytes to ``dst_fd``; returns the file length."""
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
