"""The main job end to end on an embedded default: synth -> plan -> repack -> verify.

A generated qwen3moe checkpoint and a routing trace with planted structure stand in for a real
model and a real workload, so a fresh machine can see every step work in a few seconds.
When llama.cpp is installed it also judges the repacked file against the original.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .checkpoint.model import MoeModel
from .checkpoint.synth import SynthSpec, llama_cpp_available, synth_model
from .errors import BadInput
from .jsonable import to_jsonable
from .layout.coactivation_plan import PlanOutcome, plan_from_trace
from .layout.plan import save_plan
from .llama.judge import JudgeResult
from .progress import NULL_PROGRESS, ProgressSink
from .rewrite.repack import RepackResult, repack
from .rewrite.verify import VerifyResult, verify
from .trace import save_trace, synth_trace

if TYPE_CHECKING:  # llama.cpp is optional: imported only when a judgement runs
    from .llama.judge import JudgeResult

DEMO_SPEC = SynthSpec(
    layers=4, experts=32, top_k=4, hidden=256, expert_ffn=256, weight_type="Q8_0", seed=0
)
DEMO_TOKENS = 4096
MARKER = ".moepack-demo"


@dataclass
class DemoResult:
    folder: Path
    model: Path
    model_bytes: int
    trace: Path
    trace_tokens: int
    plan: Path
    planning: PlanOutcome
    repacked: RepackResult
    verified: VerifyResult
    judge: JudgeResult | None = None
    steps: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return {
            "folder": str(self.folder),
            "model": str(self.model),
            "model_bytes": self.model_bytes,
            "trace": str(self.trace),
            "trace_tokens": self.trace_tokens,
            "plan": str(self.plan),
            "requests_per_token_before": self.planning.requests_before,
            "requests_per_token_after": self.planning.requests_after,
            "repacked": to_jsonable(self.repacked),
            "verified": to_jsonable(self.verified),
            "judge": to_jsonable(self.judge) if self.judge is not None else None,
        }


def run_demo(
    folder: str | os.PathLike[str],
    judge_with_llama: bool = True,
    progress: ProgressSink = NULL_PROGRESS,
) -> DemoResult:
    """Run every step in ``folder``: created if missing, or a folder an earlier demo made
    (marked by ``MARKER``; its files are replaced). Any other non-empty folder is refused, so
    the demo can never overwrite a user's files."""
    d = Path(folder)
    if d.exists() and not d.is_dir():
        raise BadInput("is not a folder", d)
    if d.is_dir() and any(d.iterdir()) and not (d / MARKER).is_file():
        raise BadInput(
            "folder is not empty and was not made by moepack demo; choose another --dir", d
        )
    d.mkdir(parents=True, exist_ok=True)
    (d / MARKER).write_text("made by moepack demo; its files are replaced on every run\n")
    model_path, trace_path = d / "model.gguf", d / "model.moetrace"
    plan_path, out_path = d / "model.moeplan", d / "model-repacked.gguf"
    for p in (model_path, trace_path, plan_path, out_path):
        p.unlink(missing_ok=True)
    synth = synth_model(model_path, DEMO_SPEC, progress=progress)
    with MoeModel(model_path) as model:
        trace = synth_trace(model, tokens=DEMO_TOKENS, prefill_tokens=256, seed=0)
        save_trace(trace, trace_path)
        planning = plan_from_trace(model, trace, model_label=model_path, trace_label=trace_path)
    save_plan(planning.plan, plan_path)
    repacked = repack(model_path, planning.plan, out_path, plan_path=plan_path, progress=progress)
    verified = verify(model_path, out_path, progress=progress)
    judged = None
    if judge_with_llama and llama_cpp_available():
        from .llama.judge import judge

        judged = judge(model_path, out_path)
    return DemoResult(
        d,
        model_path,
        synth.file_bytes,
        trace_path,
        trace.tokens,
        plan_path,
        planning,
        repacked,
        verified,
        judged,
    )
