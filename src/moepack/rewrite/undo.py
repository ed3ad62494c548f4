"""Undoing a repack from the file alone: the original, byte for byte, from the provenance.

A permutation-only repack is undone by repacking with the inverse plan. A layout rewrite
(version 2 provenance) is undone by describing the original file in terms of the repacked one
(``target``): the recorded tensor order says which repacked tensor (or which half of a fused
one) each original tensor is, the inverse permutation which slot each original expert came
from, the recorded alignment what ``general.alignment`` was, and the recorded shard counts
(when the repack cut the shards elsewhere) which original shard each tensor was in.
"""

from __future__ import annotations

import os
import time

import numpy as np
from gguf.constants import GGUF_DEFAULT_ALIGNMENT

from ..checkpoint.model import MoeModel
from ..checkpoint.provenance import RepackProvenance, read_provenance
from ..errors import BadInput
from ..progress import NULL_PROGRESS, ProgressSink
from .header import KEEP, assemble_header, shard_metadata
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
    """The original's tensors per shard, in its tensor-info order, made of ``model``'s bytes
    (in the shard the provenance says, or else in the one the repacked tensor is in)."""
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
    counts = prov.shards
    home = [k for k, n in enumerate(counts) for _ in range(n)] if counts is not None else None
    if home is not None and len(home) != len(order):
        raise BadInput("provenance shard counts do not add up to its tensor order", where)
    shards: list[list[OutTensor]] = [[] for _ in (counts if counts is not None else model.shards)]
    for k, v in enumerate(order.tolist()):
        i, h = divmod(int(v), 2)
        shard, t = rep[i]
        goes = home[k] if home is not None else shard
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
            shards[goes].append(OutTensor(name, t.ggml_type, ne, n, (part,), inv))
        else:
            part = Part.whole(t, shard, n)
            info = info_prefix(model, t.name)
            shards[goes].append(OutTensor(t.name, t.ggml_type, t.ne, n, (part,), inv, info))
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
    for i, tensors in enumerate(shards):
        data.append(assign_offsets(tensors, alignment))
        kvs = shard_metadata(
            model,
            i,
            len(shards),
            n_orig,
            KEEP if prov.alignment is None else prov.alignment or None,
        )
        infos = [t.tensor_info() for t in tensors]
        like = model.shards[min(i, len(model.shards) - 1)]  # its GGUF magic and version
        headers.append(assemble_header(like, [raw for _, raw in kvs], infos))
    dests, written = write_outputs(
        model,
        out,
        list(model.shard_paths),
        lambda i, fd: write_target_shard(
            model.shard_paths, fd, headers[i], shards[i], alignment, data[i], progress
        ),
        need_bytes=model.file_bytes,
        what="the original model",
        label=f"undoing {model.path.name}",
        progress=progress,
        shards=len(shards),
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
