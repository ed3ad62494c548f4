"""``trace synth``: a synthetic trace with planted structure, written to a file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..progress import NULL_PROGRESS, ProgressSink
from .binding import optional_model
from .convert import check_output
from .formats import SaveResult, save_trace
from .synth import synth_trace


@dataclass
class SynthTraceResult:
    """The written file, the trace's shape and the parameters that planted its structure."""

    output: SaveResult
    tokens: int
    prefill_tokens: int
    layers: int
    n_expert: int
    k: int
    clusters: int
    params: dict[str, Any]
    model: str | None = None


def write_synth_trace(
    out: Path,
    model_path: Path | None = None,
    to: str | None = None,
    pmx_version: int | None = None,
    progress: ProgressSink = NULL_PROGRESS,
    **params: Any,
) -> SynthTraceResult:
    """Synthesise a trace (``params`` as for ``synth_trace``), for the model at ``model_path``
    or for the sizes in ``params``, and write it to ``out`` (format from ``to`` or the
    extension). The output format is checked before any work."""
    version = check_output(out, to, pmx_version)
    with optional_model(model_path) as model:
        trace = synth_trace(model, **params)
    saved = save_trace(
        trace,
        out,
        format=to,
        version=version,
        inputs=(model_path,) if model_path else (),
        progress=progress,
    )
    info = trace.provenance["synth"]
    return SynthTraceResult(
        output=saved,
        tokens=trace.tokens,
        prefill_tokens=trace.prefill_tokens,
        layers=trace.layers,
        n_expert=trace.n_expert,
        k=trace.k,
        clusters=int(info["params"]["clusters"]),
        params=dict(info["params"]),
        model=str(model_path) if model_path else None,
    )
