"""``synth --trace-out / --prompts-out``: a synthetic model and the routing trace and prompts
made for it, written together (made from the staged model, so all appear or none does).
With planted routing the trace is the routing the prompts will show."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint.model import MoeModel
from ..checkpoint.synth import SynthModelResult, SynthSpec, synth_model
from ..errors import BadInput
from ..filekinds import PROMPTS, check_output_kind
from ..progress import NULL_PROGRESS, ProgressSink
from ..safeio import check_destination, real
from ..trace import save_trace, synth_trace
from ..trace.formats import output_format
from .routing_prompts import RoutingPrompt, load_routing_plan, prompt_file_bytes
from .routing_prompts import routing_prompts as make_prompts
from .routing_trace import planted_trace


@dataclass
class SynthPairResult:
    """The model written and, when asked for, the trace beside it."""

    model: SynthModelResult
    trace: Path | None = None
    tokens: int = 0
    prompts: Path | None = None
    prompt_count: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "trace": self.trace,
            "tokens": self.tokens,
            "prompts": self.prompts,
            "prompt_count": self.prompt_count,
        }


def synth_model_with_trace(
    out: Path,
    spec: SynthSpec,
    *,
    split_max_size: int = 0,
    trace_out: Path | None = None,
    tokens: int = 4096,
    prefill: int = 0,
    progress: ProgressSink = NULL_PROGRESS,
    prompts_out: Path | None = None,
    n_prompts: int = 16,
    prompt_tokens: int = 128,
    threads: int | None = None,
) -> SynthPairResult:
    """Write the model ``spec`` describes to ``out`` (``threads`` tensors at once, default
    every core) and, with ``trace_out``, a trace of
    ``tokens`` tokens (``prefill`` of them prefill) with clusters planted for it; with planted
    routing (``spec.routing``), ``prompts_out`` gets ``n_prompts`` prompts of
    ``prompt_tokens`` tokens and the trace is their planted routing."""
    if prompts_out is not None:
        if spec.routing is None:
            raise BadInput("`prompts_out` needs `routing` (prompts follow the planted topics)")
        check_destination(check_output_kind(prompts_out, PROMPTS), [])
        if real(prompts_out) in (real(out), real(trace_out or out)):
            raise BadInput("`prompts_out` is the same path as another output", prompts_out)
    if trace_out is not None:
        output_format(trace_out)
        check_destination(trace_out, [])
        if real(trace_out) == real(out):
            raise BadInput("`trace_out` is the same path as `out`", trace_out)
        if prefill > tokens:
            raise BadInput(f"`prefill` {prefill} is longer than `tokens` {tokens}")

    def planted_prompts(staged_model: Path) -> list[RoutingPrompt]:
        plan, n_vocab = load_routing_plan(staged_model)
        return make_prompts(plan, n_vocab, n_prompts, prompt_tokens, spec.seed)

    def write_trace(staged_model: Path, staging: Path, dest: Path) -> list[tuple[Path, Path]]:
        staged = staging / dest.name
        if spec.routing is not None:  # the routing the prompts will show
            run = [t for p in planted_prompts(staged_model) for t in p.tokens]
            about = {"prompts": n_prompts, "prompt_tokens": prompt_tokens, "seed": spec.seed}
            save_trace(planted_trace(staged_model, np.asarray(run), about), staged)
            return [(staged, dest)]
        with MoeModel(staged_model) as m:
            save_trace(
                synth_trace(m, tokens=tokens, prefill_tokens=prefill, seed=spec.seed), staged
            )
        return [(staged, dest)]

    def write_prompts(staged_model: Path, staging: Path, dest: Path) -> list[tuple[Path, Path]]:
        staged = staging / f"prompts{dest.suffix}"
        prompts = planted_prompts(staged_model)
        staged.write_bytes(prompt_file_bytes(prompts, dest.suffix == ".jsonl"))
        return [(staged, dest)]

    def companions(staged_model: Path, staging: Path) -> list[tuple[Path, Path]]:
        pairs = [] if trace_out is None else write_trace(staged_model, staging, trace_out)
        if prompts_out is not None:
            pairs += write_prompts(staged_model, staging, prompts_out)
        return pairs

    model = synth_model(
        out,
        spec,
        split_max_size,
        progress=progress,
        companions=companions if trace_out is not None or prompts_out is not None else None,
        threads=threads,
    )
    traced = (n_prompts * prompt_tokens if spec.routing else tokens) if trace_out else 0
    return SynthPairResult(model, trace_out, traced, prompts_out, n_prompts if prompts_out else 0)
