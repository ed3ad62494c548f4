"""What the trace commands share about the model a trace belongs to: opening it when one is
named, and the record of how a trace fits it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..checkpoint.model import MoeModel
from .core import RoutingTrace


@contextmanager
def optional_model(path: Path | None) -> Iterator[MoeModel | None]:
    """The model at ``path`` (closed on leaving), or ``None`` when no model was named."""
    if path is None:
        yield None
        return
    model = MoeModel(path)
    try:
        yield model
    finally:
        model.close()


def binding(trace: RoutingTrace, model: MoeModel, blocks: list[int]) -> dict[str, Any]:
    """How ``trace`` fits ``model``: its blocks and whether the recorded fingerprint matches."""
    return {
        "model": str(model.path),
        "fingerprint": model.fingerprint,
        "fingerprint_matches": trace.model_fingerprint == model.fingerprint
        if trace.model_fingerprint
        else None,
        "blocks": blocks,
    }
