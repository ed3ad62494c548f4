"""What of a model decides how fast it runs: per-layer shapes and types, and where its bytes
are (experts, dense, the output head), read from the GGUF index alone.

The ``shape_key`` names a calibration: two models with the same per-layer shapes and types
compute a token in the same time per layer, whatever their depth or expert count.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import asdict, dataclass

from ..checkpoint.model import MoeModel
from ..errors import BadInput


@dataclass(frozen=True)
class ModelShape:
    architecture: str
    moe_layers: int  # MoE blocks llama.cpp runs
    blocks: int  # all blocks (dense ones too)
    n_expert: int
    top_k: int
    hidden: int
    expert_ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    expert_type: str  # the ggml type holding most expert bytes
    matrices: int  # expert matrices per layer (3, or 2 with gate+up fused)
    slice_bytes: tuple[int, ...]  # one expert's slice of each matrix
    bytes_per_expert: int  # one expert of one layer, all matrices
    expert_bytes: int  # every routed expert of the layers that run
    file_bytes: int
    output_bytes: int  # the output head (or the tied embedding) read every token
    outside_bytes: int = 0  # tensors outside the blocks: embedding, output head, final norm

    @property
    def dense_bytes(self) -> int:
        """Everything but routed experts: attention, norms, routers, embeddings, shared
        experts, dense blocks (read every token, pinned by the prefetcher)."""
        return self.file_bytes - self.expert_bytes

    @property
    def block_bytes(self) -> float:
        """Bytes the blocks read per decoded token: every block's dense weights (attention,
        norms, routers, shared experts) and each MoE layer's top-k experts."""
        dense = max(0, self.dense_bytes - self.outside_bytes)
        return dense + self.active_expert_bytes

    @property
    def expert_column_bytes(self) -> float:
        """One expert id's bytes in every MoE layer (what reading "expert e" of each layer
        costs)."""
        return self.expert_bytes / max(1, self.n_expert)

    @property
    def active_expert_bytes(self) -> int:
        """Expert bytes one token's routing reads (top-k per MoE layer; layers whose
        experts are of a larger type, as a Q4_K_M file's Q6_K ones, count as they are)."""
        return self.top_k * self.expert_bytes // max(1, self.n_expert)

    def shape_key(self) -> str:
        """What a calibration depends on: the per-layer shapes and types (not depth, not the
        expert count: a token computes top-k experts however many there are)."""
        doc = {
            "arch": self.architecture,
            "top_k": self.top_k,
            "hidden": self.hidden,
            "expert_ffn": self.expert_ffn,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "expert_type": self.expert_type,
            "matrices": self.matrices,
        }
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = asdict(self)
        out["dense_bytes"] = self.dense_bytes
        out["active_expert_bytes"] = self.active_expert_bytes
        out["shape_key"] = self.shape_key()
        return out


def _int_meta(model: MoeModel, key: str, default: int) -> int:
    v = model.shards[0].get(key.format(arch=model.architecture))
    if isinstance(v, list):
        v = max((int(x) for x in v), default=0)
    return int(v) if isinstance(v, int) and v > 0 else default


def model_shape(model: MoeModel) -> ModelShape:
    """The shape of ``model``'s first MoE block that runs, its depth and its byte totals."""
    run = [b for b in model.blocks if b.runs]
    if not run:
        raise BadInput("no MoE block llama.cpp runs: fit estimates MoE models", model.path)
    first = run[0]
    mats = first.weight_tensors
    by_kind = {t.kind: t for t in mats}
    up = by_kind.get("up") or by_kind.get("gate_up") or mats[0]
    hidden = int(up.entry.ne[0])
    ffn = int(up.entry.ne[1]) // (2 if up.kind == "gate_up" else 1)
    types: Counter[str] = Counter()
    for t in mats:
        types[t.entry.type_name] += t.entry.n_bytes
    heads = _int_meta(model, "{arch}.attention.head_count", max(1, hidden // 128))
    head_dim = _int_meta(model, "{arch}.attention.key_length", max(1, hidden // heads))
    embd = model.tensors.get("token_embd.weight")
    out = model.tensors.get("output.weight") or embd
    vocab = int(embd.ne[1]) if embd is not None and len(embd.ne) > 1 else 0
    return ModelShape(
        architecture=model.architecture,
        moe_layers=len(run),
        blocks=model.block_count or len(model.blocks),
        n_expert=first.n_expert,
        top_k=first.top_k or model.top_k,
        hidden=hidden,
        expert_ffn=ffn,
        heads=heads,
        kv_heads=_int_meta(model, "{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        vocab=vocab,
        expert_type=types.most_common(1)[0][0],
        matrices=len(mats),
        slice_bytes=tuple(t.slice_bytes for t in mats),
        bytes_per_expert=sum(t.slice_bytes for t in mats),
        expert_bytes=sum(sum(t.entry.n_bytes for t in b.weight_tensors) for b in run),
        file_bytes=model.file_bytes,
        output_bytes=out.n_bytes if out is not None else 0,
        outside_bytes=sum(t.n_bytes for n, t in model.tensors.items() if not n.startswith("blk.")),
    )
