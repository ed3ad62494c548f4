"""Where a replay reads experts from: a GGUF at any layout's offsets (one read per expert
matrix: three, or two when gate and up are fused), or an expert-major store (one read per
expert record). Either way, one file and, per trace layer, each expert's reads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checkpoint.model import MoeModel
from ..errors import BadInput
from ..layout.layout import LayoutOptions, place
from ..layout.plan import Plan
from ..pages import release_mapped
from ..store import ExpertStore


@dataclass
class ExpertFile:
    """Per trace layer, the ``(offset, length)`` of each read that fetches expert ``e``:
    ``offsets[layer][e, part]`` and ``lengths[layer][e, part]``, all in ``path``."""

    label: str
    kind: str  # "gguf" or "store"
    layout: str
    path: Path
    offsets: list[np.ndarray]
    lengths: list[np.ndarray]
    release: Callable[[], None]  # let go of this process's mapped pages of ``path``

    def expert_bytes(self, layer: int) -> int:
        return int(self.lengths[layer].sum(axis=1).max())

    def reads_per_expert(self, layer: int) -> int:
        return int(self.offsets[layer].shape[1])

    @property
    def regions(self) -> list[tuple[int, int]]:
        """The byte ranges the replay may read (one per layer)."""
        return [
            (int(o.min()), int((o + n).max()))
            for o, n in zip(self.offsets, self.lengths, strict=True)
        ]


def gguf_source(
    model: MoeModel, block_map: list[int], layout: str = "identity", plan: Plan | None = None
) -> ExpertFile:
    """The trace layers' experts in ``model`` under ``layout`` (``place``'s offsets)."""
    placement = place(model, layout, LayoutOptions(plan=plan))
    shards = {placement.block(b).shard for b in block_map}
    if len(shards) != 1:
        raise BadInput(
            f"replay reads one file; these blocks sit in shards {sorted(shards)}", model.path
        )
    shard = shards.pop()
    offsets, lengths = [], []
    for b in block_map:
        bp = placement.block(b)
        offsets.append(np.stack([t.offsets for t in bp.tensors], axis=1).astype(np.int64))
        lengths.append(
            np.stack(
                [np.full(bp.n_expert, t.slice_bytes, dtype=np.int64) for t in bp.tensors], axis=1
            )
        )
    data = model.shards[shard].reader.data
    mm = getattr(data, "_mmap", None)
    path = model.shard_paths[shard]
    size = path.stat().st_size
    return ExpertFile(
        str(model.path),
        "gguf",
        placement.name,
        path,
        offsets,
        lengths,
        lambda: release_mapped(mm, 0, size),
    )


def store_source(store: ExpertStore, block_map: list[int]) -> ExpertFile:
    """The trace layers' experts in an expert-major store: one read per expert, its parts'
    exact span (the record's trailing padding is not asked for)."""
    offsets, lengths = [], []
    for b in block_map:
        recs = sorted(store.experts(b), key=lambda r: r.expert)
        if [r.expert for r in recs] != list(range(len(recs))):
            raise BadInput(f"block {b} of the store does not hold experts 0..{len(recs) - 1}")
        spans = np.asarray([r.span for r in recs], dtype=np.int64)
        offsets.append(spans[:, :1].copy())
        lengths.append(spans[:, 1:] - spans[:, :1])
    return ExpertFile(
        str(store.path), "store", "expert-major store", store.data_path, offsets, lengths, _nothing
    )


def _nothing() -> None:
    """A store is read with plain reads, never mapped: nothing to release."""
