"""``trace capture``: real routing from llama.cpp, recorded through its eval callback.

llama.cpp names every MoE layer's router choice ``ffn_moe_topk-<block>`` in every family it
runs, so capture needs no per-architecture code: the GGUF says which blocks are MoE blocks
(dense leading layers have no router), llama.cpp says which experts each token chose there.
The run happens in a child process (``capture_worker``; a bad model can abort llama.cpp),
which spools ids and router weights to raw files beside the output after every decode call;
the parent then writes the trace from memory maps of the spool in bounded chunks, so a
million-token capture never sits in RAM.

Per-prompt phases: tokens of prompt ``i`` are contiguous, prefill first, then decode. The
trace carries them as its ``segments`` (``RoutingTrace.prompt_segments``, ``phase_mask``,
``token_prompts``), and its provenance ``capture.prompts`` lists ``{prompt, start, prefill,
decode}`` for every prompt as the worker reported it.

Ctrl-C (or SIGTERM) stops the child after the decode call in progress: the trace written is
complete up to that token and says ``capture.truncated: true``; an interrupt before any token
was routed writes nothing.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...checkpoint.model import MoeModel
from ...errors import BadInput
from ...progress import NULL_PROGRESS, ProgressSink
from ...safeio import check_destination, describe_os_error
from ...trace.core import PromptSegment, RoutingTrace, id_dtype_for
from ...trace.formats import SaveResult, output_format, save_trace
from ..protocol.child import run_worker, scratch_folder
from ..protocol.spool import spooled
from .prompts import Prompt

PHASE_PREFILL = 0
PHASE_DECODE = 1


@dataclass(frozen=True)
class CaptureOptions:
    """How the workload runs. ``temp == 0`` is greedy; ``n_ctx == 0`` takes the model's
    training context. ``n_ubatch`` is llama.cpp's micro-batch (routing is the same for any)."""

    n_predict: int = 0
    chat: bool = False
    temp: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    threads: int = 2
    n_ctx: int = 0
    n_batch: int = 512
    n_ubatch: int = 512

    def validate(self) -> None:
        if self.n_predict < 0:
            raise BadInput(f"n-predict must be >= 0, got {self.n_predict}")
        if self.temp < 0:
            raise BadInput(f"temperature must be >= 0, got {self.temp}")
        if not 0.0 < self.top_p <= 1.0:
            raise BadInput(f"top-p must be in (0, 1], got {self.top_p}")
        if self.threads < 1 or self.n_batch < 1 or self.n_ubatch < 1 or self.n_ctx < 0:
            raise BadInput("threads, batch and micro-batch must be >= 1, context >= 0")


@dataclass
class CaptureResult:
    """What was captured and written."""

    model: Path
    out: Path
    format: str
    prompts: int
    tokens: int
    prefill_tokens: int
    decode_tokens: int
    layers: int
    k: int
    n_expert: int
    block_map: list[int]
    truncated: bool
    seconds: float
    saved: SaveResult
    dropped: list[str] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "model": str(self.model),
            "out": str(self.out),
            "format": self.format,
            "prompts": self.prompts,
            "tokens": self.tokens,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "layers": self.layers,
            "k": self.k,
            "n_expert": self.n_expert,
            "block_map": self.block_map,
            "truncated": self.truncated,
            "seconds": round(self.seconds, 3),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "bytes": self.saved.bytes,
            "dropped": self.dropped,
        }


@dataclass(frozen=True)
class ModelFacts:
    """What the parent knows of the model before llama.cpp sees it. ``blocks`` are the MoE
    blocks llama.cpp runs: a multi-token-prediction block (``checkpoint.nextn``) is loaded
    and never run, so it routes nothing and is no trace layer."""

    fingerprint: str
    blocks: list[int]
    n_expert: int
    k: int
    shards: list[Path]
    context: int  # the training context the GGUF declares (0: none)


def model_facts(path: Path) -> ModelFacts:
    """The MoE blocks, expert count and top-k of ``path``; a dense model is bad input."""
    if not path.is_file():
        raise BadInput("no such file", path)
    with MoeModel(path) as m:
        if not m.blocks:
            raise BadInput("a dense model: no MoE block routes experts, nothing to capture", path)
        if m.n_expert < 1:
            raise BadInput("MoE blocks with different expert counts are not supported", path)
        ks = {b.top_k for b in m.blocks}
        k = ks.pop() if len(ks) == 1 else 0
        if k < 1:
            raise BadInput("the model does not say how many experts a token uses", path)
        if not m.run_block_indices:
            raise BadInput(
                f"llama.cpp runs none of the MoE blocks: blocks {m.not_run_block_indices} are "
                f"next-token-prediction blocks ({m.architecture}.nextn_predict_layers = "
                f"{m.nextn_layers}), which it loads and never runs",
                path,
            )
        context = int(m.shards[0].get_int(f"{m.architecture}.context_length", 0) or 0)
        return ModelFacts(m.fingerprint, m.run_block_indices, m.n_expert, k, m.shard_paths, context)


class _CaptureProgress:
    """The worker's ``plan`` and ``tokens`` events as a progress bar."""

    def __init__(self, progress: ProgressSink) -> None:
        self.progress = progress
        self.started = False

    def __call__(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "plan":
            self.progress.start("capturing routing", int(event["tokens"]), unit="tok")
            self.started = True
        elif kind == "tokens":
            self.progress.advance(int(event["n"]))

    def finish(self) -> None:
        if self.started:
            self.progress.finish()


def run_capture_child(
    job: dict[str, Any], model: Path, progress: ProgressSink
) -> tuple[dict[str, Any], bool]:
    """Run the capture worker on ``job`` (its spool folder holds the job file); return its
    ``done`` event and whether an interrupt stopped it early."""
    shown = _CaptureProgress(progress)
    try:
        outcome = run_worker(
            "moepack.llama.runtime.capture_worker",
            job,
            folder=Path(job["spool"]),
            model=model,
            on_event=shown,
        )
    finally:
        shown.finish()
    return outcome.done, outcome.interrupted


def capture_trace(
    model: str | os.PathLike[str],
    out: str | os.PathLike[str],
    prompts: list[Prompt],
    options: CaptureOptions = CaptureOptions(),
    *,
    format: str | None = None,
    progress: ProgressSink = NULL_PROGRESS,
) -> CaptureResult:
    """Run ``prompts`` through ``model`` in llama.cpp and write the routing trace to ``out``."""
    model_path = Path(model)
    options.validate()
    facts = model_facts(model_path)
    dest = check_destination(out, facts.shards)
    fmt = output_format(dest, format)
    if not prompts:
        raise BadInput("no prompts to run")
    id_dtype = id_dtype_for(facts.n_expert)
    with scratch_folder(dest.name, near=dest.parent) as spool:
        job = {
            "model": str(model_path),
            "spool": str(spool),
            "blocks": facts.blocks,
            "k": facts.k,
            "id_dtype": id_dtype.name,
            "prompts": [p.to_job() for p in prompts],
            "chat": options.chat,
            "n_predict": options.n_predict,
            "temp": options.temp,
            "top_p": options.top_p,
            "seed": options.seed,
            "threads": options.threads,
            "n_ctx": options.n_ctx,
            "n_ctx_train": facts.context,
            "n_batch": options.n_batch,
            "n_ubatch": options.n_ubatch,
        }
        try:
            t0 = time.perf_counter()
            done, _interrupted = run_capture_child(job, model_path, progress)
            seconds = time.perf_counter() - t0
            tokens = int(done["tokens"])
            if tokens == 0:
                raise KeyboardInterrupt  # stopped before any token was routed: write nothing
            trace = spooled_trace(spool, tokens, facts, done, options, prompts)
            tokens, prefill = trace.tokens, trace.prefill_tokens
            saved = save_trace(
                trace, dest, format=fmt.NAME, inputs=tuple(facts.shards), progress=progress
            )
            del trace
        except OSError as e:
            raise describe_os_error(e, dest) from None
    segments = done["segments"]
    return CaptureResult(
        model=model_path,
        out=dest,
        format=saved.format,
        prompts=len(segments),
        tokens=tokens,
        prefill_tokens=prefill,
        decode_tokens=tokens - prefill,
        layers=len(facts.blocks),
        k=facts.k,
        n_expert=facts.n_expert,
        block_map=facts.blocks,
        truncated=bool(done["truncated"]),
        seconds=seconds,
        saved=saved,
        dropped=saved.dropped,
    )


def spooled_trace(
    spool: Path,
    tokens: int,
    facts: ModelFacts,
    done: dict[str, Any],
    options: CaptureOptions,
    prompts: list[Prompt],
) -> RoutingTrace:
    """The spooled capture as a ``RoutingTrace`` over memory maps (nothing loaded whole)."""
    import llama_cpp

    segments = [{k: int(v) for k, v in s.items()} for s in done["segments"]]
    covered = sum(s["prefill"] + s["decode"] for s in segments)
    if segments and covered < tokens:
        tokens = covered  # a prompt cut short by a failure has no segment: keep whole prompts
    shape = (tokens, len(facts.blocks), facts.k)
    ids = spooled(spool, "ids", id_dtype_for(facts.n_expert), shape)
    weights = spooled(spool, "weights", np.dtype("<f4"), shape)
    provenance = {
        "capture": {
            "tool": "moepack trace capture",
            "engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})",
            "prompts": segments,
            "prompt_count": len(prompts),
            "truncated": bool(done["truncated"]),
            "n_predict": options.n_predict,
            "chat": options.chat,
            "sampling": (
                {"greedy": True}
                if options.temp == 0
                else {"temp": options.temp, "top_p": options.top_p, "seed": options.seed}
            ),
            "threads": options.threads,
            "n_ubatch": options.n_ubatch,
        }
    }
    return RoutingTrace(
        ids=ids,
        n_expert=facts.n_expert,
        weights=weights,
        segments=[PromptSegment(s["start"], s["prefill"], s["decode"]) for s in segments] or None,
        block_map=list(facts.blocks),
        model_fingerprint=facts.fingerprint,
        provenance=provenance,
    )


def capture_segments(trace: RoutingTrace) -> list[dict[str, int]]:
    """Per-prompt segments ``{prompt, start, prefill, decode}`` of a trace (one for a trace
    of one prompt)."""
    return [
        {"prompt": i, "start": s.start, "prefill": s.prefill, "decode": s.decode}
        for i, s in enumerate(trace.prompt_segments)
    ]


def token_prompts(trace: RoutingTrace) -> np.ndarray:
    """The prompt index of every token."""
    return trace.token_prompts()


def token_phases(trace: RoutingTrace) -> np.ndarray:
    """``PHASE_PREFILL`` / ``PHASE_DECODE`` per token."""
    return np.where(trace.phase_mask("prefill"), PHASE_PREFILL, PHASE_DECODE).astype(np.int8)
