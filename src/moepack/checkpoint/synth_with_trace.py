"""``synth --trace-out``: a synthetic model and a routing trace made for it, written together
(the trace is synthesised from the staged model, so both appear or neither does)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BadInput
from ..progress import NULL_PROGRESS, ProgressSink
from ..safeio import check_destination
from .model import MoeModel
from .synth import SynthModelResult, SynthSpec, synth_model


@dataclass
class SynthPairResult:
    """The model written and, when asked for, the trace beside it."""

    model: SynthModelResult
    trace: Path | None = None
    tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "trace": self.trace, "tokens": self.tokens}


def synth_model_with_trace(
    out: Path,
    spec: SynthSpec,
    split_max_size: int = 0,
    trace_out: Path | None = None,
    tokens: int = 4096,
    prefill: int = 0,
    progress: ProgressSink = NULL_PROGRESS,
) -> SynthPairResult:
    """Write the model ``spec`` describes to ``out`` and, with ``trace_out``, a trace of
    ``tokens`` tokens (``prefill`` of them prefill) with clusters planted for it."""
    from ..trace import save_trace, synth_trace
    from ..trace.formats import output_format

    if trace_out is not None:
        output_format(trace_out)
        check_destination(trace_out, [])
        if trace_out.resolve() == out.resolve():
            raise BadInput("--trace-out is the same path as --out", trace_out)
        if prefill > tokens:
            raise BadInput(f"--prefill {prefill} is longer than --tokens {tokens}")

    def write_trace(staged_model: Path, staging: Path) -> list[tuple[Path, Path]]:
        assert trace_out is not None
        staged = staging / trace_out.name
        with MoeModel(staged_model) as m:
            save_trace(
                synth_trace(m, tokens=tokens, prefill_tokens=prefill, seed=spec.seed), staged
            )
        return [(staged, trace_out)]

    model = synth_model(
        out,
        spec,
        split_max_size,
        progress=progress,
        companions=write_trace if trace_out is not None else None,
    )
    return SynthPairResult(model, trace_out, tokens if trace_out else 0)
