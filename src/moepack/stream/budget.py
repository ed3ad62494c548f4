"""A cache budget in bytes or in slots, turned into slots per layer.

A budget in bytes is shared evenly by the layers (each layer's share holds as many of its
experts as fit); a budget in slots is per layer, as llama.cpp's ``--moe-stream-cache N`` is.
A layer must hold at least one token's top-k: a smaller budget is refused, naming the minimum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import BadInput


@dataclass(frozen=True)
class CacheBudget:
    """``bytes`` for all layers together, or ``slots`` per layer (exactly one is set)."""

    bytes: int | None = None
    slots: int | None = None

    def __post_init__(self) -> None:
        if (self.bytes is None) == (self.slots is None):
            raise BadInput(
                "a cache budget is `bytes` for all layers or `slots` per layer: give one"
            )
        if (self.bytes is not None and self.bytes <= 0) or (
            self.slots is not None and self.slots <= 0
        ):
            raise BadInput("the cache budget must be positive")

    @property
    def label(self) -> str:
        return f"{self.slots} slots/layer" if self.slots is not None else f"{self.bytes} B"

    def minimum_bytes(self, expert_bytes: list[int], k: int) -> int:
        """The smallest byte budget that holds ``k`` experts in every layer."""
        return k * len(expert_bytes) * max(expert_bytes)

    def slots_per_layer(self, expert_bytes: list[int], k: int, n_expert: list[int]) -> list[int]:
        """Slots of each layer (never more than the layer has experts); ``BadInput`` when a
        layer would hold fewer than ``k``."""
        if self.slots is not None:
            slots = [self.slots] * len(expert_bytes)
        else:
            assert self.bytes is not None
            share = self.bytes // max(1, len(expert_bytes))
            slots = [share // b for b in expert_bytes]
        low = min(range(len(slots)), key=lambda i: slots[i])
        if slots[low] < k:
            raise BadInput(
                f"a cache of {self.label} holds {slots[low]} experts in trace layer {low}, "
                f"fewer than the top-{k} one token needs; the minimum is {k} slots per layer "
                f"({self.minimum_bytes(expert_bytes, k)} bytes)"
            )
        return [min(s, n) for s, n in zip(slots, n_expert, strict=True)]

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "slots_per_layer": self.slots}
