"""Undoing a repack from the file alone: the original, byte for byte, from the provenance.

A permutation-only repack is undone by repacking with the inverse plan. A layout rewrite
(version 2 provenance) is undone by describing the original file in terms of the repacked one
(``target``): the recorded tensor order says which repacked tensor (or which half of a fused
one) each original tensor is, the inverse permutation which slot each original expert came
from, and the recorded alignment what ``general.alignment`` was.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
from gguf.constants import GGUF_DEFAULT_ALIGNMENT

from ..checkpoint.model import MoeModel
from ..checkpoint.provenance import RepackProvenance, read_provenance
from ..errors import BadInput
from ..progress import NULL_PROGRESS, ProgressSink
from .header import assemble_header, kept_metadata, set_alignment, set_tensor_count
from .layout_target import info_prefix
from .repack import RepackResult, repack, undo_plan
from .target import OutTensor, Part, assign_offsets
from .write_target import write_outputs, write_target_shard


def undo(
    model_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    progress: ProgressSink = NULL_PROGRESS,
) -> RepackResult:
    """Write the original of the repacked ``model_path`` to ``out``."""
    with MoeModel(model_path) as model:
        prov = read_provenance(model)
        if prov is None:
            raise BadInput("has no moepack provenance: nothing to undo", model.path)
        if not prov.changes_layout:
            plan = undo_plan(model_path)
        else:
            return _undo_layout(model, prov, out, progress)
    return repack(model_path, plan, out, progress=progress)


def original_tensors(model: MoeModel, prov: RepackProvenance) -> list[list[OutTensor]]:
    """The original's tensors per shard, in its tensor-info order, made of ``model``'s bytes."""
    rep = [(i, t) for i, s in enumerate(model.shards) for t in s.tensors]
    where = model.shard_paths[0]
    order = prov.order if prov.order is not None else np.zeros(0, np.int64)
    fused = set(prov.fused)
    expert_of = {t.name: b for b in model.blocks for t in b.tensors}
    halves: dict[int, list[int]] = {}
    for v in order.tolist():
        i, h = divmod(int(v), 2)
        if not 0 <= i < len(rep):
            raise BadInput(f"provenance tensor order names tensor {i} of {len(rep)}", where)
        halves.setdefault(i, []).append(h)
    for i, (_, t) in enumerate(rep):
        block = expert_of.get(t.name)
        two = (
            block is not None
            and block.index in fused
            and t.name.endswith(".ffn_gate_up_exps.weight")
        )
        if sorted(halves.get(i, [])) != ([0, 1] if two else [0]):
            raise BadInput(f"provenance tensor order does not account for {t.name!r} once", where)
    shards: list[list[OutTensor]] = [[] for _ in model.shards]
    for v in order.tolist():
        i, h = divmod(int(v), 2)
        shard, t = rep[i]
        block = expert_of.get(t.name)
        n = block.n_expert if block is not None else 1
        inv = None
        if block is not None and block.index in prov.perms:
            inv = np.argsort(prov.perms[block.index]).astype(np.int64)
        if (
            block is not None
            and block.index in fused
            and t.name.endswith(".ffn_gate_up_exps.weight")
        ):
            half = (t.n_bytes // n) // 2
            kind = "ffn_up_exps" if h else "ffn_gate_exps"
            ne = (t.ne[0], t.ne[1] // 2, *t.ne[2:])
            name = t.name.replace("ffn_gate_up_exps", kind, 1)
            part = Part(t, shard, n, h * half, half)
            shards[shard].append(OutTensor(name, t.ggml_type, ne, n, (part,), inv))
        else:
            part = Part.whole(t, shard, n)
            info = info_prefix(model, t.name)
            shards[shard].append(OutTensor(t.name, t.ggml_type, t.ne, n, (part,), inv, info))
    return shards


def _undo_layout(
    model: MoeModel,
    prov: RepackProvenance,
    out: str | os.PathLike[str],
    progress: ProgressSink,
) -> RepackResult:
    t0 = time.perf_counter()
    shards = original_tensors(model, prov)
    if prov.alignment is None:
        alignment = model.shards[0].alignment
    else:
        alignment = prov.alignment or GGUF_DEFAULT_ALIGNMENT
    n_orig = sum(len(ts) for ts in shards)
    headers, data = [], []
    for shard, tensors in zip(model.shards, shards, strict=True):
        data.append(assign_offsets(tensors, alignment))
        kvs = kept_metadata(shard)
        if prov.alignment is not None:
            kvs = set_alignment(kvs, shard, prov.alignment or None)
        kvs = set_tensor_count(kvs, shard, n_orig)
        infos = [t.tensor_info() for t in tensors]
        headers.append(assemble_header(shard, [raw for _, raw in kvs], infos))
    dests, written = write_outputs(
        model,
        out,
        list(model.shard_paths),
        lambda i, fd: write_target_shard(
            Path(model.shard_paths[i]), i, fd, headers[i], shards[i], alignment, data[i], progress
        ),
        need_bytes=model.file_bytes,
        what="the original model",
        label=f"undoing {model.path.name}",
        progress=progress,
    )
    permuted = sum(1 for ts in shards for t in ts if t.perm is not None)
    return RepackResult(
        outputs=dests,
        blocks_permuted=sorted(prov.perms),
        tensors_permuted=permuted,
        tensors_copied=n_orig - permuted,
        bytes_written=written,
        provenance_recorded=False,
        seconds=time.perf_counter() - t0,
        notes=["the original restored from the file's provenance: layout, order and alignment"],
        layout="undo",
        alignment=alignment,
    )
