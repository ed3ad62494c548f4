"""``store_info``: what a store holds, per block, without reading its data."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf.constants import GGMLQuantizationType

from .format import VERSION
from .reader import open_store


@dataclass
class StoreInfo:
    path: Path
    version: int
    fingerprint: str
    model: str
    architecture: str
    layout: str
    alignment: int
    file_bytes: int
    payload_bytes: int
    blocks: list[dict[str, Any]]
    precision: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "version": self.version,
            "fingerprint": self.fingerprint,
            "model": self.model,
            "architecture": self.architecture,
            "layout": self.layout,
            "alignment": self.alignment,
            "file_bytes": self.file_bytes,
            "payload_bytes": self.payload_bytes,
            "blocks": self.blocks,
            "precision": self.precision,
        }


def store_info(path: str | os.PathLike[str]) -> StoreInfo:
    """The index of the store at ``path``, summarised per block."""
    with open_store(path) as store:
        blocks = []
        for b in store.blocks:
            bi = store.block_index(b)
            types: dict[str, int] = {}
            for rec in bi.experts:
                for p in rec.parts:
                    name = GGMLQuantizationType(p.ggml_type).name
                    types[name] = types.get(name, 0) + 1
            blocks.append(
                {
                    "block": b,
                    "n_expert": bi.n_expert,
                    "parts": [s.kind for s in bi.sources],
                    "types": types,
                    "record_bytes": sum(r.size for r in bi.experts),
                }
            )
        return StoreInfo(
            path=store.path,
            version=VERSION,
            fingerprint=store.fingerprint,
            model=store.index.model,
            architecture=store.index.architecture,
            layout=store.index.layout,
            alignment=store.alignment,
            file_bytes=store.header.index_offset + store.header.index_length,
            payload_bytes=store.payload_bytes,
            blocks=blocks,
            precision=store.index.precision is not None,
        )
