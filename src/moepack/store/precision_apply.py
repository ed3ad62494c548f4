"""Applying a precision plan while a store is built, and again when it is verified.

``PlanRequantiser`` is what ``build_store`` asks for each part's type and for the bytes of a
requantised part; it measures each requantised expert with ``compare``'s metrics as it goes and
records, in the store's index, which quantiser wrote each type. ``requantiser_from_index``
rebuilds the same requantisation from that record, so ``verify_store`` can check a requantised
part byte for byte.
"""

from __future__ import annotations

import os
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGMLQuantizationType

from ..checkpoint.model import ExpertTensor, MoeModel
from ..errors import BadInput
from ..quant.metrics import DiffStats
from ..quant.quantiser import QUANTISERS, Quantiser, quantiser_for
from ..quant.requant import requantise
from ..storage.copy import pread_exact
from .placement import slice_shape
from .precision_plan import PrecisionPlan, part_type


class Requantisation:
    """Requantises slices with one quantiser per type; owns the source descriptors. Safe to
    call from several threads (verify checks two records at a time)."""

    def __init__(self, quantisers: dict[int, Quantiser]) -> None:
        self.quantisers = quantisers
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self.stats: dict[tuple[int, int], DiffStats] = {}

    def _source_slice(self, model: MoeModel, tensor: ExpertTensor, expert: int) -> np.ndarray:
        """One expert's slice of ``tensor``, read with pread (nothing stays mapped)."""
        with self._lock:
            fd = self._fds.get(tensor.shard)
            if fd is None:
                path = model.shard_paths[tensor.shard]
                fd = self._fds[tensor.shard] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        buf = bytearray(tensor.slice_bytes)
        pread_exact(fd, memoryview(buf), tensor.slice_offset(expert))
        return np.frombuffer(buf, dtype=np.uint8)

    def part_bytes(
        self, model: MoeModel, tensor: ExpertTensor, expert: int, ggml_type: int
    ) -> bytes:
        q = self.quantisers.get(ggml_type)
        if q is None:
            raise BadInput(f"no quantiser is recorded for {GGMLQuantizationType(ggml_type).name}")
        raw = self._source_slice(model, tensor, expert)
        shape = slice_shape(tensor)
        done = requantise(raw, tensor.entry.ggml_type, GGMLQuantizationType(ggml_type), shape[0], q)
        with self._lock:
            self.stats.setdefault((tensor.block, expert), DiffStats()).merge(done.stats)
        return done.data

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class PlanRequantiser(Requantisation):
    """A precision plan as ``build_store``'s ``Requantiser``."""

    def __init__(self, plan: PrecisionPlan) -> None:
        super().__init__({})
        self.plan = plan
        self.source_bytes = self.planned_bytes = 0  # measured on the model by check_against

    @property
    def path(self) -> Path | None:
        return self.plan.path

    def stored_type(self, block: int, expert: int, source_type: int, shape: tuple[int, ...]) -> int:
        return part_type(self.plan.target(block, expert), source_type, shape)

    def check_against(self, model: MoeModel) -> None:
        self.plan.check_against(model)
        self.source_bytes, self.planned_bytes = self.plan.stored_bytes(model)
        for row in self.plan.blocks.values():
            for t in row:
                if t is not None and t not in self.quantisers:
                    self.quantisers[t] = quantiser_for(GGMLQuantizationType(t))

    def summary(self) -> dict[str, Any]:
        experts = []
        for (block, expert), stats in sorted(self.stats.items()):
            target = self.plan.target(block, expert)
            counts = self.plan.counts.get(block, [])
            experts.append(
                {
                    "block": block,
                    "expert": expert,
                    "type": GGMLQuantizationType(target).name if target is not None else None,
                    "count": counts[expert] if expert < len(counts) else None,
                    "metrics": asdict(stats.metrics()),
                }
            )
        return {
            "plan": str(self.plan.path) if self.plan.path else None,
            "budget_bytes": self.plan.budget_bytes,
            "source_bytes": self.source_bytes,
            "planned_bytes": self.planned_bytes,
            "bytes_saved": self.source_bytes - self.planned_bytes,
            "requantised": len(experts),
            "quantisers": {
                GGMLQuantizationType(t).name: q.name for t, q in sorted(self.quantisers.items())
            },
            "experts": experts,
        }


def requantiser_from_index(
    doc: dict[str, Any] | None, store: str | os.PathLike[str]
) -> Requantisation | None:
    """The requantisation a store's index records (None when it records none)."""
    if not doc:
        return None
    named = doc.get("quantisers")
    if not isinstance(named, dict):
        raise BadInput("store index: precision.quantisers is not an object", store)
    quantisers: dict[int, Quantiser] = {}
    for type_name, q_name in named.items():
        try:
            qtype = GGMLQuantizationType[str(type_name)]
        except KeyError:
            raise BadInput(f"store index: unknown type {type_name!r} in precision", store) from None
        q = QUANTISERS.get(str(q_name))
        why = q.unavailable_reason()
        if why is not None:
            raise BadInput(f"checking {type_name} parts needs the {q.name} quantiser: {why}", store)
        quantisers[int(qtype)] = q
    return Requantisation(quantisers)
