"""The main job end to end on an embedded default, so a fresh machine sees every step work.

With llama.cpp installed the demo closes the loop a user cares about: a generated qwen3moe
checkpoint whose real llama.cpp routing has planted structure, and prompts for it; routing
captured from llama.cpp over those prompts; a plan made from the first prompts and scored on
the whole prompts held out (tokens the planner never saw); a repack, verified byte for byte,
and judged by llama.cpp (same logits, and the repack's captured routing maps back through its
permutation on every token). Without llama.cpp (or with ``use_llama=False``) a synthetic
trace stands in for the capture and the llama.cpp steps are skipped; results say which.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .checkpoint.model import MoeModel
from .checkpoint.routing import RoutingSpec
from .checkpoint.synth import SynthSpec, llama_cpp_available, synth_model
from .errors import BadInput
from .jsonable import to_jsonable
from .layout.coactivation_plan import PlanOutcome, plan_from_trace
from .layout.heldout import PromptSplit, requests_per_token, split_by_prompts
from .layout.plan import save_plan
from .planted.synth_with_trace import synth_model_with_trace
from .progress import NULL_PROGRESS, ProgressSink
from .rewrite.repack import RepackResult, repack
from .rewrite.verify import VerifyResult, verify
from .safeio import replacing, write_bytes_atomic
from .trace import save_trace, synth_trace

if TYPE_CHECKING:  # llama.cpp is optional: imported only when its steps run
    from .llama.judge.judge import JudgeResult
    from .trace.routing_map import RoutingAgreement

DEMO_SPEC = SynthSpec(
    layers=4, experts=32, top_k=4, hidden=256, expert_ffn=256, weight_type="Q8_0", seed=0
)
# The llama.cpp loop: the same shape, with routing llama.cpp really follows (clusters of
# top-k experts, topics that persist, layers coupled) and a vocabulary of words per topic.
ROUTED_SPEC = SynthSpec(
    layers=4,
    experts=32,
    top_k=4,
    hidden=256,
    expert_ffn=256,
    vocab=2048,
    weight_type="Q8_0",
    seed=0,
    routing=RoutingSpec(cluster_size=4, stay=0.8, coupling=0.85, skew=1.0),
)
DEMO_TOKENS = 4096
DEMO_PROMPTS = 16
PROMPT_TOKENS = 128
TRAIN_PROMPTS = 12  # planned from; the other prompts are held out
MARKER = ".moepack-demo"
MARKER_TEXT = b"made by moepack demo; its files are replaced on every run\n"
NO_LLAMA_ENV = "MOEPACK_DEMO_NO_LLAMA"  # set to 1: the synthetic-trace demo even with llama.cpp


@dataclass
class HeldOut:
    """Read requests per token on the held-out prompts, in the original order and the plan's."""

    split: PromptSplit
    requests_before: float
    requests_after: float

    def to_json(self) -> dict[str, object]:
        return {
            **self.split.to_json(),
            "requests_per_token_before": self.requests_before,
            "requests_per_token_after": self.requests_after,
        }


@dataclass(kw_only=True)
class DemoResult:
    folder: Path
    trace_source: str  # "captured" (llama.cpp over the prompts) or "synthetic"
    model: Path
    model_bytes: int
    trace: Path
    trace_tokens: int
    plan: Path
    planning: PlanOutcome
    repacked: RepackResult
    verified: VerifyResult
    prompts: Path | None = None
    prompt_count: int = 0
    capture_seconds: float = 0.0
    held_out: HeldOut | None = None
    judge: JudgeResult | None = None
    repacked_trace: Path | None = None
    routing: RoutingAgreement | None = None
    steps: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return {
            "folder": str(self.folder),
            "trace_source": self.trace_source,
            "model": str(self.model),
            "model_bytes": self.model_bytes,
            "prompts": str(self.prompts) if self.prompts else None,
            "prompt_count": self.prompt_count,
            "trace": str(self.trace),
            "trace_tokens": self.trace_tokens,
            "capture_seconds": round(self.capture_seconds, 3),
            "plan": str(self.plan),
            "plan_tokens": self.planning.trace_tokens,
            "requests_per_token_before": self.planning.requests_before,
            "requests_per_token_after": self.planning.requests_after,
            "held_out": to_jsonable(self.held_out) if self.held_out else None,
            "repacked": to_jsonable(self.repacked),
            "verified": to_jsonable(self.verified),
            "judge": to_jsonable(self.judge) if self.judge is not None else None,
            "repacked_trace": str(self.repacked_trace) if self.repacked_trace else None,
            "routing": to_jsonable(self.routing) if self.routing is not None else None,
        }


def _prepare(folder: str | os.PathLike[str]) -> Path:
    """``folder`` created if missing, or one an earlier demo made (marked by ``MARKER``; its
    files are replaced). Any other non-empty folder is refused: the demo never overwrites a
    user's files."""
    d = Path(folder)
    if d.exists() and not d.is_dir():
        raise BadInput("is not a folder", d)
    if d.is_dir() and any(d.iterdir()) and not (d / MARKER).is_file():
        raise BadInput(
            "folder is not empty and was not made by moepack demo; choose another `folder`", d
        )
    d.mkdir(parents=True, exist_ok=True)
    with replacing():  # the folder is the demo's own: its marker and files are replaced
        write_bytes_atomic(d / MARKER, MARKER_TEXT)
    for name in DEMO_FILES:
        (d / name).unlink(missing_ok=True)
    return d


DEMO_FILES = (
    "model.gguf",
    "model.prompts.jsonl",
    "model.moetrace",
    "model.moeplan",
    "model-repacked.gguf",
    "model-repacked.moetrace",
)


def wants_llama(use_llama: bool | None) -> bool:
    """``use_llama`` if given, else: llama.cpp installed and ``NO_LLAMA_ENV`` not set."""
    if use_llama is not None:
        return use_llama
    return llama_cpp_available() and os.environ.get(NO_LLAMA_ENV, "") in ("", "0")


def run_demo(
    folder: str | os.PathLike[str],
    use_llama: bool | None = None,
    progress: ProgressSink = NULL_PROGRESS,
) -> DemoResult:
    """Run every step in ``folder`` (see the module docstring); ``use_llama`` None means
    whenever llama.cpp is installed (see ``wants_llama``)."""
    d = _prepare(folder)
    with replacing():  # the folder is the demo's own (marked): its files are replaced
        if wants_llama(use_llama):
            if not llama_cpp_available():
                raise BadInput("llama.cpp is not installed: pip install 'moepack[llama]'")
            return _captured_demo(d, progress)
        return _synthetic_demo(d, progress)


def _repack_and_verify(
    model_path: Path, planning: PlanOutcome, plan_path: Path, out_path: Path, progress: ProgressSink
) -> tuple[RepackResult, VerifyResult]:
    """Save the plan, repack the model by it and check every byte of the result."""
    save_plan(planning.plan, plan_path)
    repacked = repack(model_path, planning.plan, out_path, plan_path=plan_path, progress=progress)
    return repacked, verify(model_path, out_path, progress=progress)


def _synthetic_demo(d: Path, progress: ProgressSink) -> DemoResult:
    model_path, trace_path = d / "model.gguf", d / "model.moetrace"
    plan_path, out_path = d / "model.moeplan", d / "model-repacked.gguf"
    synth = synth_model(model_path, DEMO_SPEC, progress=progress)
    with MoeModel(model_path) as model:
        trace = synth_trace(model, tokens=DEMO_TOKENS, prefill_tokens=256, seed=0)
        save_trace(trace, trace_path)
        planning = plan_from_trace(model, trace, model_label=model_path, trace_label=trace_path)
    repacked, verified = _repack_and_verify(model_path, planning, plan_path, out_path, progress)
    return DemoResult(
        folder=d,
        trace_source="synthetic",
        model=model_path,
        model_bytes=synth.file_bytes,
        trace=trace_path,
        trace_tokens=trace.tokens,
        plan=plan_path,
        planning=planning,
        repacked=repacked,
        verified=verified,
    )


def _captured_demo(d: Path, progress: ProgressSink) -> DemoResult:
    from .llama.judge.judge import judge
    from .llama.runtime.capture import CaptureOptions, capture_trace
    from .llama.runtime.prompts import read_prompt_file
    from .trace import load_trace
    from .trace.routing_map import routing_maps_back

    model_path, prompts_path = d / "model.gguf", d / "model.prompts.jsonl"
    trace_path, plan_path = d / "model.moetrace", d / "model.moeplan"
    out_path, out_trace = d / "model-repacked.gguf", d / "model-repacked.moetrace"
    synth = synth_model_with_trace(
        model_path,
        ROUTED_SPEC,
        progress=progress,
        prompts_out=prompts_path,
        n_prompts=DEMO_PROMPTS,
        prompt_tokens=PROMPT_TOKENS,
    )
    prompts = read_prompt_file(prompts_path)
    options = CaptureOptions(threads=2)
    captured = capture_trace(model_path, trace_path, prompts, options, progress=progress)
    with MoeModel(model_path) as model:
        trace = load_trace(trace_path, model=model)
        split = split_by_prompts(trace, TRAIN_PROMPTS)
        label = f"{trace_path} (prompts 1-{TRAIN_PROMPTS} of {len(prompts)})"
        planning = plan_from_trace(model, split.train, model_label=model_path, trace_label=label)
        before, after = requests_per_token(model, split.held_out, planning.plan)
    repacked, verified = _repack_and_verify(model_path, planning, plan_path, out_path, progress)
    judged = judge(model_path, out_path)
    capture_trace(out_path, out_trace, prompts, options, progress=progress)
    with MoeModel(out_path) as repacked_model:
        routing = routing_maps_back(trace, load_trace(out_trace, model=repacked_model), out_path)
    return DemoResult(
        folder=d,
        trace_source="captured",
        model=model_path,
        model_bytes=synth.model.file_bytes,
        trace=trace_path,
        trace_tokens=trace.tokens,
        plan=plan_path,
        planning=planning,
        repacked=repacked,
        verified=verified,
        prompts=prompts_path,
        prompt_count=len(prompts),
        capture_seconds=captured.seconds,
        held_out=HeldOut(split, before, after),
        judge=judged,
        repacked_trace=out_trace,
        routing=routing,
    )
