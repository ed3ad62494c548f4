"""``trace info``: read, validate and summarise a trace, and check it against a model."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..binding import shape_only_warnings
from ..errors import one_line
from .binding import binding, optional_model
from .formats import detect_format, get_format, load_trace
from .stats import TraceStats, summarize

LLAMA_MAX_EXPERTS = 512
"""The most experts per layer llama.cpp loads (``LLAMA_MAX_EXPERTS``, set for Qwen3-Next):
a trace declaring more was recorded on no model llama.cpp runs."""


@dataclass
class TraceInfo:
    """A trace's format, size and statistics (with its binding to a model when one was given)."""

    format: str
    file_bytes: int
    stats: TraceStats
    warnings: list[str] = field(default_factory=list)  # bound to the model by shape only

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "file_bytes": self.file_bytes,
            **self.stats.to_json(),
            "warnings": self.warnings,
        }


def trace_info(
    path: Path,
    fmt: str | None = None,
    n_expert: int | None = None,
    model_path: Path | None = None,
    lag: int = 8,
    window: int = 1024,
    block_map: list[int] | None = None,
) -> TraceInfo:
    """Read, validate and summarise a trace (and check it against a model when given).
    ``block_map`` sets the trace's block map first (checked against the model, if any)."""
    mod = get_format(fmt) if fmt else detect_format(path)
    with optional_model(model_path) as model:
        trace = load_trace(path, format=mod.NAME, n_expert=n_expert, model=model, check=False)
        if block_map is not None:
            trace = trace.replace(block_map=block_map)
        blocks = trace.check_against(model) if model is not None else None
        stats = summarize(trace, lag=lag, window=window, blocks=blocks)
        warnings: list[str] = []
        if model is not None and blocks is not None:
            stats.binding = binding(trace, model, blocks)
            warnings = shape_only_warnings("trace", trace.model_fingerprint, path, model.path)
        if trace.n_expert > LLAMA_MAX_EXPERTS:
            used = int(trace.layer_max.max()) + 1 if trace.tokens else 0
            warnings.append(
                one_line(
                    f"{path}: declares {trace.n_expert:,} experts per layer, more than any model "
                    f"llama.cpp runs ({LLAMA_MAX_EXPERTS}); its routes use experts below {used:,}"
                )
            )
    return TraceInfo(mod.NAME, path.stat().st_size, stats, warnings)
