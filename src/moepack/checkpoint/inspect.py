"""``inspect``: where a MoE checkpoint's expert bytes sit, per model and per layer, which
orders llama.cpp's routing allows (routing groups, chunk experts), and which MoE blocks
llama.cpp loads but never runs (multi-token-prediction blocks, ``checkpoint.nextn``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .experts import split_block_name
from .model import MoeModel


@dataclass
class TensorReport:
    name: str
    kind: str
    type: str
    bits_per_weight: float
    ne: list[int]
    tensor_bytes: int
    slice_bytes: int
    offset: int
    shard: int


@dataclass
class LayerReport:
    block: int
    n_expert: int
    top_k: int
    bytes_per_expert: int
    expert_bytes: int
    tensors: list[TensorReport]
    constraints: list[dict[str, object]] = field(default_factory=list)
    runs: bool = True  # False: a multi-token-prediction block llama.cpp never runs


@dataclass
class FlaggedReport:
    name: str
    block: int
    role: str
    reason: str


@dataclass
class InspectResult:
    path: Path
    shards: list[Path]
    architecture: str
    gguf_version: int
    alignment: int
    file_bytes: int
    n_tensors: int
    block_count: int
    moe_blocks: list[int]
    dense_blocks: list[int]
    # <arch>.nextn_predict_layers, and the MoE blocks among those llama.cpp loads but never runs
    nextn_layers: int
    not_run_blocks: list[int]
    n_expert: int
    top_k: int
    expert_groups: int  # <arch>.expert_group_count (0: no grouped routing)
    expert_groups_used: int
    expert_bytes: int
    expert_share: float
    fingerprint: str
    provenance: dict[str, object]
    layers: list[LayerReport] = field(default_factory=list)
    flagged: list[FlaggedReport] = field(default_factory=list)


def inspect_model(
    path: str | os.PathLike[str],
    assume_expert: tuple[str, ...] = (),
    assume_not_expert: tuple[str, ...] = (),
) -> InspectResult:
    """Open ``path`` (any shard of a split checkpoint) and describe its expert layout."""
    with MoeModel(path, assume_expert, assume_not_expert) as m:
        layers = [
            LayerReport(
                block=b.index,
                n_expert=b.n_expert,
                top_k=b.top_k,
                bytes_per_expert=b.bytes_per_expert,
                expert_bytes=b.expert_bytes,
                tensors=[
                    TensorReport(
                        name=t.name,
                        kind=t.kind,
                        type=t.entry.type_name,
                        bits_per_weight=t.entry.bits_per_weight,
                        ne=list(t.entry.ne),
                        tensor_bytes=t.entry.n_bytes,
                        slice_bytes=t.slice_bytes,
                        offset=t.entry.offset,
                        shard=t.shard,
                    )
                    for t in b.tensors
                ],
                constraints=[c.to_json() for c in b.constraints],
                runs=b.runs,
            )
            for b in m.blocks
        ]
        block_ids = {p[0] for n in m.tensors if (p := split_block_name(n)) is not None}
        moe = m.moe_block_indices
        return InspectResult(
            path=m.path,
            shards=m.shard_paths,
            architecture=m.architecture,
            gguf_version=m.shards[0].version,
            alignment=m.shards[0].alignment,
            file_bytes=m.file_bytes,
            n_tensors=len(m.tensors),
            block_count=m.block_count,
            moe_blocks=moe,
            dense_blocks=sorted(block_ids - set(moe)),
            nextn_layers=m.nextn_layers,
            not_run_blocks=m.not_run_block_indices,
            n_expert=m.n_expert,
            top_k=m.top_k,
            expert_groups=m.n_expert_group,
            expert_groups_used=m.n_expert_group_used,
            expert_bytes=m.expert_bytes,
            expert_share=m.expert_bytes / m.file_bytes if m.file_bytes else 0.0,
            fingerprint=m.fingerprint,
            provenance={
                k: (v if not isinstance(v, list) or len(v) <= 16 else f"[{len(v)} values]")
                for k, v in m.provenance().items()
            },
            layers=layers,
            flagged=[FlaggedReport(f.name, f.block, f.role.value, f.reason) for f in m.flagged],
        )
