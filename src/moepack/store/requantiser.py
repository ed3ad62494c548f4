"""What ``build_store`` needs from a precision plan: each part's type, and requantised bytes.

A protocol, so the build depends on this interface only; ``precision_apply`` implements it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from ..checkpoint.model import ExpertTensor, MoeModel


class Requantiser(Protocol):
    def stored_type(self, block: int, expert: int, source_type: int, shape: tuple[int, ...]) -> int:
        """The ggml type a part (of ``source_type`` and ``shape``) of ``expert`` is stored as."""

    @property
    def path(self) -> Path | None:
        """The plan file it came from (an input the store must not overwrite)."""

    def check_against(self, model: MoeModel) -> None:
        """``BadInput`` unless the plan is for ``model`` and within its budget."""

    def part_bytes(
        self, model: MoeModel, tensor: ExpertTensor, expert: int, ggml_type: int
    ) -> bytes:
        """``expert``'s slice of ``tensor`` requantised to ``ggml_type``."""

    def summary(self) -> dict[str, Any]:
        """What the index records about the requantisation (the plan, the quantisers, errors)."""

    def close(self) -> None:
        """Release what reading the source took (file descriptors)."""
