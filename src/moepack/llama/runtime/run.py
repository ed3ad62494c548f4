"""``moepack run``: generation in llama.cpp (a child process), with or without the expert
prefetcher, measured the way streaming is judged: tokens/s per phase, bytes read, major page
faults and prefetch time per token.

The parent checks the inputs (a MoE GGUF, prompts, an engine and depth this machine serves),
records each shard's identity so the child can tell when the file changes under it, and
relays the child's generated text as it comes. Prompts run in order, each from an empty
context (read from files by ``prompts.read_prompt_file``, as ``trace capture`` reads them).
A trace is spooled to disk by the child and written from memory maps, as capture's is.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ...checkpoint.model import MoeModel
from ...errors import BadInput
from ...safeio import check_destination, real
from ...storage.linux import mem_available
from ...trace.core import PromptSegment, RoutingTrace, id_dtype_for
from ...trace.formats import load_trace, output_format, save_trace
from ..prefetcher.prefetch import ExpertRanges, choose_engine
from ..prefetcher.streamer import StreamOptions, check_pager_budget
from ..protocol.child import Warnings, run_worker, scratch_folder
from ..protocol.spool import spooled
from .choice import AutoStream, Prefetch, StreamingChoice, choose_streaming
from .draft import DraftOptions, check_draft_model
from .identity import FileIdentity
from .placement import CHOICES
from .prompts import Prompt, text_prompt


@dataclass
class RunPhaseTotals:
    """One phase (prefill or decode) as the child measured it."""

    tokens: int
    seconds: float
    counters: dict[str, int]
    prefetch: dict[str, float]
    draft: dict[str, Any] = field(default_factory=dict)
    moe_layers: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def per_token(self, value: float) -> float:
        return value / self.tokens if self.tokens else 0.0

    @property
    def expert_hit_rate(self) -> float | None:
        """Chosen experts whose every byte was already cached when the router chose them."""
        chosen = self.prefetch.get("demand_experts", 0)
        return self.prefetch.get("demand_hits", 0) / chosen if chosen else None

    def to_json(self) -> dict[str, Any]:
        c, p = self.counters, self.prefetch
        device = c.get("read_bytes", 0)
        wanted = p.get("bytes_read", 0)
        callback = p.get("seconds_in_callback", 0.0)
        return {
            "tokens": self.tokens,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            # what the device delivered to this process (faults, read-ahead, reads)
            "bytes_read_per_token": self.per_token(device),
            "major_faults_per_token": self.per_token(c.get("major_faults", 0)),
            "minor_faults_per_token": self.per_token(c.get("minor_faults", 0)),
            # what the prefetcher found missing and asked for; the device's bytes beyond
            # it are fault read-around and reads of pages evicted before use
            "prefetch_bytes_per_token": self.per_token(wanted),
            "device_bytes_beyond_prefetch_per_token": self.per_token(max(0, device - wanted)),
            "prefetch_reads_per_token": self.per_token(p.get("calls_read", 0)),
            "prefetch_seconds": callback,
            "prefetch_share": callback / self.seconds if self.seconds else 0.0,
            "expert_hit_rate": self.expert_hit_rate,
            "cache_hit_rate": _share(p.get("cache_hits", 0), p.get("cache_accesses", 0)),
            "lookahead_recall": _share(p.get("lookahead_hits", 0), p.get("lookahead_chosen", 0)),
            "lookahead_precision": _share(
                p.get("lookahead_hits", 0), p.get("lookahead_predicted", 0)
            ),
            # the pager's: faults that waited for a read, bytes it read (O_DIRECT)
            "pager_faults_per_token": self.per_token(p.get("pager_fault_waits", 0)),
            "pager_read_bytes_per_token": self.per_token(p.get("pager_read_bytes", 0)),
            "cpu_seconds": c.get("cpu_ns", 0) / 1e9,
            "counters": c,
            "prefetch": p,
            "draft": self.draft_summary(),
        }

    def draft_summary(self) -> dict[str, Any] | None:
        """Drafting's record (None when nothing was drafted or verified in this phase):
        drafted and accepted tokens, the acceptance rate, tokens per verification pass, the
        distinct experts a verification batch chose per MoE layer against its rows x top-k
        (what one token at a time would route), and the bytes per accepted token."""
        d = self.draft
        if not d or not (d.get("verify_passes") or d.get("single_passes")):
            return None
        layers = max(self.moe_layers, 1)
        vp, sp = d["verify_passes"], d["single_passes"]
        return {
            **d,
            "lengths": {str(k): v for k, v in sorted(d["lengths"].items())},
            "acceptance_rate": _share(d["accepted"], d["drafted"]),
            "tokens_per_verify_pass": _share(vp + d["accepted"], vp),
            "experts_per_verified_batch": _share(d["verify_union_experts"], vp * layers),
            "routed_per_verified_batch": _share(d["verify_routed"], vp * layers),
            "experts_per_single_pass": _share(d["single_union_experts"], sp * layers),
            "bytes_per_accepted_token": self.per_token(self.counters.get("read_bytes", 0)),
            "prefetch_bytes_per_accepted_token": self.per_token(self.prefetch.get("bytes_read", 0)),
        }


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole else None


@dataclass
class PromptRun:
    """One prompt of a run: its length, what was generated after it, and that as text."""

    prompt_tokens: int
    generated: list[int]
    text: str

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": len(self.generated),
            "generated": self.generated,
            "text": self.text,
        }


@dataclass
class RunResult:
    model: Path
    trace: Path | None
    prefetch: StreamOptions | None
    stream: dict[str, Any] | None  # the prefetcher's record for the whole run
    threads: int
    prompt_tokens: int
    generated: list[int]
    text: str
    prefill: RunPhaseTotals
    decode: RunPhaseTotals
    no_readaround_bytes: int = 0
    cached_after_evict: int | None = None
    warnings: list[str] = field(default_factory=list)
    prompts: list[PromptRun] = field(default_factory=list)
    weights: dict[str, Any] | None = None  # the placement and what the load did (weights.py)
    draft: DraftOptions = field(default_factory=DraftOptions)
    thread_tuning: dict[str, Any] | None = None  # the decode thread count chosen (threadtune)
    streaming: dict[str, Any] | None = None  # what ran the model and why (choice)
    threads_batch: int | None = None  # for passes of more than one token

    def to_json(self) -> dict[str, Any]:
        return {
            "model": str(self.model),
            "trace": str(self.trace) if self.trace else None,
            "prefetch": asdict(self.prefetch) if self.prefetch else None,
            "draft": asdict(self.draft),
            "stream": self.stream,
            "weights": self.weights,
            "threads": self.threads,
            "threads_batch": self.threads_batch,
            "thread_tuning": self.thread_tuning,
            "streaming": self.streaming,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": len(self.generated),
            "generated": self.generated,
            "text": self.text,
            "no_readaround_bytes": self.no_readaround_bytes,
            "cached_after_evict": self.cached_after_evict,
            "warnings": self.warnings,
            "prompts": [p.to_json() for p in self.prompts],
            "prefill": self.prefill.to_json(),
            "decode": self.decode.to_json(),
        }


def _phase(d: dict[str, Any], moe_layers: int) -> RunPhaseTotals:
    draft = dict(d.get("draft") or {})
    if draft:
        draft["lengths"] = {int(k): int(v) for k, v in draft["lengths"].items()}
    return RunPhaseTotals(
        d["tokens"], d["seconds"], d["counters"], d["prefetch"], draft, moe_layers
    )


def _save_trace(model: Path, spool: Path, result: dict[str, Any], out: Path, chat: bool) -> Path:
    """The routing the child spooled, as a trace bound to ``model`` (written atomically from
    memory maps of the spool, in bounded chunks)."""
    segments = [{k: int(v) for k, v in s.items()} for s in result["segments"]]
    with MoeModel(model) as m:
        n_expert = max(b.n_expert for b in m.blocks)
        shape = (int(result["routed_tokens"]), len(result["moe_blocks"]), m.top_k)
        trace = RoutingTrace(
            ids=spooled(spool, "ids", id_dtype_for(n_expert), shape),
            n_expert=n_expert,
            segments=[PromptSegment(s["start"], s["prefill"], s["decode"]) for s in segments]
            or None,
            block_map=[int(b) for b in result["moe_blocks"]],
            model_fingerprint=m.fingerprint,
            provenance={
                "source": "moepack run",
                "model": str(model),
                # the per-prompt segments in capture's form (capture.token_prompts reads them)
                "capture": {
                    "tool": "moepack run",
                    "prompts": segments,
                    "prompt_count": len(segments),
                    "truncated": bool(result.get("truncated", False)),
                    "chat": chat,
                    "sampling": {"greedy": True},
                    "threads": int(result["threads"]),
                },
            },
        )
        save_trace(trace, out, inputs=tuple(m.shard_paths))
        del trace
    return out


def _workload(prompts: str | Prompt | Sequence[Prompt]) -> list[Prompt]:
    """The prompts to run, in order (a plain string is one prompt)."""
    if isinstance(prompts, str):
        return [text_prompt(prompts, "prompt")]
    if isinstance(prompts, Prompt):
        return [prompts]
    out = list(prompts)
    if not out:
        raise BadInput("no prompts to run")
    return out


def check_lookahead_trace(trace_path: str | os.PathLike[str], model: Path) -> None:
    """``BadInput`` unless the trace read like every trace (regular file, capped) has one
    layer per routed block llama.cpp runs of ``model`` and ids its experts can be: the
    trace-learned predictors index the model's layers with it, in the worker."""
    trace = load_trace(trace_path)
    with MoeModel(model) as m:
        blocks = ExpertRanges(m).blocks
        n_expert = max(b.n_expert for b in m.blocks)
    ids = np.asarray(trace.ids)
    if ids.ndim != 3 or ids.shape[1] != len(blocks):
        layers = ids.shape[1] if ids.ndim == 3 else 0
        why = f"a lookahead trace of {layers} layers for a model whose llama.cpp runs {len(blocks)}"
        raise BadInput(why, trace_path)
    if trace.n_expert > n_expert:
        why = (
            f"a lookahead trace of {trace.n_expert:,} experts per layer for a model with {n_expert}"
        )
        raise BadInput(why, trace_path)
    if ids.size and int(ids.max()) >= n_expert:
        why = f"a lookahead trace routing expert {int(ids.max())} of a model with {n_expert}"
        raise BadInput(why, trace_path)


def check_model(path: Path) -> tuple[list[FileIdentity], int]:
    """``BadInput`` unless ``path`` is a GGUF with routed experts; each shard's identity and
    the largest expert count of a block (what a trace's id type must hold)."""
    if not path.exists():
        raise BadInput("no such file", path)
    if not path.is_file():
        raise BadInput("not a regular file", path)
    with MoeModel(path) as model:
        if not model.blocks:
            raise BadInput("not a MoE model: no block has expert tensors", path)
        identities = [FileIdentity.of(p) for p in model.shard_paths]
        return identities, max(b.n_expert for b in model.blocks)


@dataclass(frozen=True)
class RunOptions:
    """How a generation runs in llama.cpp.

    ``prefetch``: the expert prefetcher's options (None: llama.cpp's own page faults;
    ``AutoStream``, the default: the prefetcher where the model does not fit, ``choice``).
    ``cold`` drops the model's pages (this file's only) between prefill and decode, so decode
    starts from storage. ``readaround``: fault read-around on the expert ranges of llama.cpp's
    mapping — ``off`` (``MADV_RANDOM``), ``on`` (the kernel's), ``auto`` (off where the
    overlapped prefetcher's live cache or pager manages the experts, whose reads are then
    already in flight; on otherwise, the model fitting among them). ``chat``
    renders plain prompts with the model's chat template (chat ``messages`` always are).
    ``threads``: llama.cpp's compute threads (None: ``default_threads``, every core, one
    fewer under memory pressure, the decode count then tuned by ``threadtune``);
    ``threads_batch``: for passes of more than one token (None: ``batch_threads``).
    ``memory``: the bytes the whole run may take (``auto``: the memory available less a
    margin): the dense weights, the context and the experts' share (``memory_plan``; the
    prefetcher's own ``memory`` bounds the experts further). ``spin``: how long ggml's OpenMP threads spin-wait before they sleep (``GOMP_SPINCOUNT``;
    None: ``PRESSURE_SPIN`` when the prefetcher runs on a model larger than the memory
    available, OpenMP's default otherwise — a thread spinning at a barrier while the other
    waits for a page takes the core the read-ahead and the kernel's reclaim need).
    ``lookahead_trace``: a trace whose routing fits the lookahead's predictors.
    ``placement``: where llama.cpp keeps the weights (``placement.CHOICES``; auto: the
    experts stay in the file's mapping when prefetching or when the model does not fit,
    llama.cpp's defaults, repacked kernels included, otherwise). ``draft``: drafted tokens
    verified a pass at a time (``draft.DraftOptions``; greedy tokens are the same as
    without)."""

    n_predict: int = 32
    threads: int | None = None
    threads_batch: int | None = None
    batch: int = 512
    n_ctx: int = 4096
    chat: bool = False
    prefetch: Prefetch = field(default_factory=AutoStream)
    memory: int | str = "auto"
    readaround: str = "auto"
    cold: bool = False
    spin: int | None = None
    lookahead_trace: str | None = None
    placement: str = "auto"
    draft: DraftOptions = DraftOptions()

    def validate(self) -> None:
        if self.n_predict < 0:
            raise BadInput(f"`n_predict` must be >= 0, got {self.n_predict}")
        if (self.threads is not None and self.threads < 1) or self.batch < 1 or self.n_ctx < 8:
            raise BadInput("`threads` and `batch` must be >= 1, `n_ctx` >= 8 tokens")
        if isinstance(self.memory, str) and self.memory != "auto":
            raise BadInput(f"`memory` is a byte count or auto, not {self.memory!r}")
        if isinstance(self.memory, int) and self.memory <= 0:
            raise BadInput(f"`memory` must be positive, got {self.memory}")
        if self.threads_batch is not None and self.threads_batch < 1:
            raise BadInput(f"`threads_batch` must be >= 1, got {self.threads_batch}")
        if self.readaround not in ("auto", "on", "off"):
            raise BadInput(f"`readaround` is auto, on or off, not {self.readaround!r}")
        if self.spin is not None and self.spin < 0:
            raise BadInput(f"`spin` must be >= 0, got {self.spin}")
        if self.placement not in CHOICES:
            raise BadInput(f"`placement` is one of {', '.join(CHOICES)}, not {self.placement!r}")
        if isinstance(self.prefetch, AutoStream):
            self.prefetch.options.validate()
        elif self.prefetch is not None:
            self.prefetch.validate()
        self.draft.validate()


def run_model(
    model: str | os.PathLike[str],
    prompts: str | Prompt | Sequence[Prompt],
    options: RunOptions = RunOptions(),
    *,
    logits_out: str | os.PathLike[str] | None = None,
    trace_out: str | os.PathLike[str] | None = None,
    expect: Sequence[FileIdentity] | None = None,
    continuation: str | None = None,
    on_piece: Callable[[int, str], None] | None = None,
    on_warning: Callable[[str], None] | None = None,
    on_note: Callable[[str], None] | None = None,
) -> RunResult:
    """Generate ``options.n_predict`` tokens greedily after each of ``prompts`` (in order,
    each from an empty context) in a llama.cpp worker process. Phases are summed over prompts.

    ``continuation``: text decoded token by token after the prompt instead of generated
    tokens (the first ``n_predict`` of its tokens), so that decode routes like real text.
    ``expect``: the shards' identities as the caller saw them (default: as they are now); the
    worker refuses to run, or stops, when the files differ from them.

    ``logits_out`` (an ``.npy``) receives the logits that chose each generated token and the
    last one, as float32 ``[n, vocab]``: what the prefetch must not change. ``trace_out``
    receives the routing of every token. An interrupt stops the worker after the decode call
    in progress; a trace asked for is then written up to there, and ``KeyboardInterrupt``
    raised. ``on_note`` is told, in one line, when the prefetcher was chosen unasked.
    """
    path = Path(model)
    options.validate()
    identities, n_expert = check_model(path)
    warned = Warnings(on_warning)
    settings = resolve_run(
        path,
        options.prefetch,
        threads=options.threads,
        threads_batch=options.threads_batch,
        memory=options.memory,
        n_ctx=options.n_ctx,
        n_batch=options.batch,
    )
    streaming, tune, threads = settings.streaming, settings.tune, settings.fault_threads
    if streaming.note and on_note is not None:
        on_note(streaming.note)
    prefetch = streaming.prefetch
    options = replace(
        options,
        threads=settings.threads,
        threads_batch=settings.threads_batch,
        prefetch=prefetch,
    )
    check_pager_budget(path, prefetch, threads)
    if expect is not None:
        if len(expect) != len(identities):
            raise BadInput(
                f"expected {len(expect)} shard identities, the model has {len(identities)}", path
            )
        identities = list(expect)  # the worker compares the files against these
    workload = _workload(prompts)
    if continuation and len(workload) != 1:
        raise BadInput("a continuation follows one prompt, not several")

    if prefetch is not None and prefetch.mode == "serial":
        choice = choose_engine(prefetch.engine, prefetch.queue_depth)
        if choice.warning:
            warned(choice.warning)
    if options.lookahead_trace is not None:
        check_lookahead_trace(options.lookahead_trace, path)
    if options.draft.model is not None:
        check_draft_model(options.draft.model, path)
    for out in (logits_out, trace_out):
        if out is not None and real(out) == real(path):
            raise BadInput("the output would overwrite the model", path)
    dest: Path | None = None
    if trace_out is not None:
        dest = check_destination(trace_out, [path])
        output_format(dest)  # an unknown extension fails before llama.cpp runs
    pieces: list[list[str]] = [[] for _ in workload]

    def on_event(event: dict[str, Any]) -> None:
        if event.get("event") == "piece":
            index = int(event.get("prompt", 0))
            pieces[index].append(event["piece"])
            if on_piece:
                on_piece(index, event["piece"])

    where = dest.parent if dest is not None else None
    with scratch_folder(dest.name if dest else "run", near=where) as folder:
        job = {
            "model": str(path),
            "prompts": [p.to_job() for p in workload],
            "options": asdict(options),
            "continuation": continuation,
            "logits_out": str(logits_out) if logits_out is not None else None,
            "trace": dest is not None,
            "spool": str(folder),
            "id_dtype": id_dtype_for(n_expert).name if dest else None,
            "identities": [[i.device, i.inode, i.size, i.mtime_ns] for i in identities],
            "tune_threads": list(tune) if tune else None,
        }
        outcome = run_worker(
            "moepack.llama.runtime.run_worker",
            job,
            env=_openmp_env(options, path),
            folder=folder,
            model=path,
            on_event=on_event,
            on_warning=warned,
        )
        result = outcome.done
        trace_saved: Path | None = None
        if dest is not None and result["routed_tokens"] > 0:
            trace_saved = _save_trace(path, folder, result, dest, options.chat)
    if outcome.interrupted:
        raise KeyboardInterrupt
    return RunResult(
        model=path,
        trace=trace_saved,
        prefetch=prefetch,
        streaming=streaming.to_json(),
        stream=result["stream"],
        threads=result["threads"],
        threads_batch=result.get("threads_batch"),
        prompt_tokens=result["prompt_tokens"],
        generated=result["generated"],
        text="".join("".join(p) for p in pieces),
        prefill=_phase(result["prefill"], len(result["moe_blocks"])),
        decode=_phase(result["decode"], len(result["moe_blocks"])),
        draft=options.draft,
        no_readaround_bytes=result["no_readaround_bytes"],
        cached_after_evict=result["cached_after_evict"],
        warnings=list(warned),
        weights=result.get("weights"),
        thread_tuning=result.get("thread_tuning"),
        prompts=[
            PromptRun(int(r["prompt_tokens"]), list(r["generated"]), "".join(p))
            for r, p in zip(result["prompts"], pieces, strict=True)
        ],
    )


def cores() -> int:
    """The cores this process may run on."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, n or 1)


def batch_threads(threads: int | None, threads_batch: int | None) -> int:
    """llama.cpp's threads for passes of more than one token (a prompt's ubatches, drafts'
    verification): ``threads_batch``, else ``threads`` when given, else every core. Such a
    pass reads each chosen expert once for many tokens, so its compute, not the disk, is what
    it waits for (a 1,127-token prompt of the 17 GB model took 74-81 CPU seconds, whichever
    engine read it): every core is worth having there, whatever a single-token pass runs at."""
    if threads_batch is not None:
        return threads_batch
    return threads if threads is not None else cores()


def default_threads(model: Path, available: int | None = None) -> int:
    """llama.cpp's compute threads when none are given: every core this process may run on,
    less one when the model does not fit in the memory available (``available``, else
    measured now) — then the disk is the
    limit, and a core left to the read-ahead thread and the kernel's reclaim is worth more
    than a compute thread that waits at every barrier for pages (measured on the 2-core
    machine: 2 threads at 0.75x of 1 under pressure; benchmarks/bench_draft.py)."""
    n = cores()
    with MoeModel(model) as m:
        size = m.file_bytes
    free = mem_available() if available is None else available
    return max(1, n - 1) if size > free else n


def thread_choices(model: Path, available: int | None = None) -> tuple[int, int] | None:
    """The decode thread counts ``ThreadTuner`` chooses between when none are given: one
    fewer than every core and every core, under memory pressure on more than one core (where
    neither wins everywhere); None where ``default_threads`` (every core) stands."""
    n = cores()
    if n < 2 or default_threads(model, available) == n:
        return None
    return n - 1, n


@dataclass(frozen=True)
class RunThreads:
    """llama.cpp's threads for one-token passes (the first the tuner tries, where it tunes)
    and for longer ones, and the counts the tuner chooses between."""

    threads: int
    threads_batch: int
    tune: tuple[int, int] | None

    @property
    def fault_threads(self) -> int:
        """The most threads llama.cpp computes with at once (each may hold an expert slice:
        the pager's minimum)."""
        return max(self.threads, self.threads_batch, *(self.tune or ()))


def resolve_threads(
    model: Path,
    *,
    threads: int | None,
    threads_batch: int | None,
    tune: bool = True,
    available: int | None = None,
) -> RunThreads:
    """The threads ``run`` (``tune``) or ``serve`` (no tuner) computes with, given their
    options; ``available``: the memory available (None: measured now)."""
    batch = batch_threads(threads, threads_batch)
    choices = None
    if threads is None:
        choices = thread_choices(model, available) if tune else None
        threads = default_threads(model, available)
    return RunThreads(threads, batch, choices)


@dataclass(frozen=True)
class RunSettings(RunThreads):
    """What a run resolves before it loads anything: its threads and the engine
    (``choice``)."""

    streaming: StreamingChoice


def resolve_run(
    model: Path,
    prefetch: Prefetch,
    *,
    threads: int | None,
    threads_batch: int | None,
    memory: int | str = "auto",
    n_ctx: int = 4096,
    n_batch: int = 512,
    tune: bool = True,
    prefix_cache: int = 0,
    available: int | None = None,
) -> RunSettings:
    """The threads and the engine ``run`` (``tune``) or ``serve`` (no tuner, its
    ``prefix_cache`` bytes counted in the memory) runs ``model`` with, given their options;
    ``available``: the memory available (None: measured now). ``fit`` asks the same to
    estimate what a run will do; ``BadInput`` (``choice``) where the run would be refused
    before loading."""
    t = resolve_threads(
        model, threads=threads, threads_batch=threads_batch, tune=tune, available=available
    )
    streaming = choose_streaming(
        model,
        prefetch,
        memory=memory,
        n_ctx=n_ctx,
        n_batch=n_batch,
        prefix_cache=prefix_cache,
        threads=t.fault_threads,  # faulting at once
        available=available,
    )
    return RunSettings(t.threads, t.threads_batch, t.tune, streaming)


PRESSURE_SPIN = 10_000
"""``GOMP_SPINCOUNT`` under memory pressure (OpenMP's own default is 300,000)."""


def _openmp_env(options: RunOptions, model: Path) -> dict[str, str]:
    return openmp_env(model, options.prefetch is not None, options.spin)


def openmp_env(model: Path, prefetching: bool, spin: int | None = None) -> dict[str, str]:
    """OpenMP's wait policy for a llama.cpp worker (read as libgomp loads: ``run_worker``'s
    ``env``): ``spin``, else ``PRESSURE_SPIN`` when ``prefetching`` a model larger than the
    memory available; a user's own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is left alone."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return {}
    if spin is None and prefetching:
        with MoeModel(model) as m:
            size = m.file_bytes
        spin = PRESSURE_SPIN if size > mem_available() else None
    return {} if spin is None else {"GOMP_SPINCOUNT": str(spin)}
