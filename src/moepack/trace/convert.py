"""``trace convert``: a trace from one format to another, optionally checked against and
bound to a model."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..binding import shape_only_warning
from ..errors import BadInput
from ..progress import ProgressSink
from .binding import optional_model
from .formats import SaveResult, detect_format, get_format, load_trace, output_format, save_trace


def check_output(dst: Path, to: str | None, pmx_version: int | None) -> int | None:
    """Check before any work that the output's format is known; a pmxtrace version is only
    meaningful for pmxtrace output. Returns the version to write."""
    out_mod = output_format(dst, to)
    if pmx_version is not None and out_mod.NAME != "pmxtrace":
        raise BadInput("`pmx_version` applies only to pmxtrace output", dst)
    return pmx_version


@dataclass
class ConvertResult:
    """What was read and what was written (``output.dropped``: what the format lost)."""

    input: Path
    input_format: str
    output: SaveResult
    tokens: int
    layers: int
    bound_to: str | None = None
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # e.g. bound by shape only


def trace_convert(
    src: Path,
    dst: Path,
    *,
    to: str | None = None,
    src_format: str | None = None,
    n_expert: int | None = None,
    model_path: Path | None = None,
    pmx_version: int | None = None,
    strict: bool = False,
    progress: ProgressSink | None = None,
    block_map: list[int] | None = None,
) -> ConvertResult:
    """Convert a trace between formats. ``block_map`` sets the trace's block map first. With a
    model, the trace is checked against it and the output records the model's fingerprint and
    the block map."""
    version = check_output(dst, to, pmx_version)
    in_mod = get_format(src_format) if src_format else detect_format(src)
    bound = None
    model_files: tuple[Path, ...] = ()
    warnings: list[str] = []
    with optional_model(model_path) as model:
        trace = load_trace(src, format=in_mod.NAME, n_expert=n_expert, model=model, check=False)
        if block_map is not None:
            trace = trace.replace(block_map=block_map)
        if model is not None:
            if trace.model_fingerprint is None:
                warnings.append(shape_only_warning("trace", src, model.path))
            trace = trace.bound_to(model)
            bound = str(model.path)
            model_files = tuple(model.shard_paths)
    kwargs: dict[str, Any] = {"progress": progress} if progress is not None else {}
    out = save_trace(
        trace, dst, format=to, version=version, strict=strict, inputs=model_files, **kwargs
    )
    notes = [str(n) for n in trace.provenance.get("notes", []) or []]
    return ConvertResult(
        input=src,
        input_format=in_mod.NAME,
        output=out,
        tokens=trace.tokens,
        layers=trace.layers,
        bound_to=bound,
        notes=notes,
        warnings=warnings,
    )
