"""``moepack serve``: an OpenAI-compatible server on one MoE model, in a llama.cpp worker.

The parent checks the inputs (a MoE GGUF, a trace destination and its format, a lookahead
trace that exists), binds the listening socket (``listening``), starts the worker
(``serve.worker``, which inherits it) through ``child.run_worker`` with OpenMP's wait policy
in its environment (``run.openmp_env``: low spinning while prefetching a model larger than
memory), tells the caller the URL once the worker listens, and collects the traced requests'
segments as they come. A worker that dies once it has served (a request llama.cpp crashed
on, though the checks are there so none does) is started again on the same socket and the
same spool (``Restarts``: at most 5 in 60 s), with one warning. The server runs until
interrupted: the worker cuts the generation in progress at its next token, refuses what
waits, and answers. A trace asked for is then written from the worker's spool (memory maps,
in bounded chunks, atomically), with one prompt segment per request, and ``Stopped`` (a
``KeyboardInterrupt``) raised with what the server did (``StopAccount``), for the command's
last line; so is a trace of the requests whose routing was whole when a second interrupt
stopped the worker at once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..checkpoint.model import MoeModel
from ..errors import BadInput
from ..interrupts import Stopped
from ..llama.prefetcher.streamer import check_pager_budget
from ..llama.protocol.child import Warnings, WorkerDied, run_worker, scratch_folder
from ..llama.protocol.spool import spooled
from ..llama.runtime.choice import AutoStream, Prefetch
from ..llama.runtime.draft import DraftOptions, check_draft_model
from ..llama.runtime.placement import CHOICES as PLACEMENTS
from ..llama.runtime.run import (
    check_lookahead_trace,
    check_model,
    openmp_env,
    resolve_run,
)
from ..safeio import check_destination
from ..trace.core import PromptSegment, RoutingTrace, id_dtype_for
from ..trace.formats import output_format, save_trace
from .apikey import ENV as API_KEY_ENV
from .listening import listen
from .names import ModelNames
from .prefixcache import budget_bytes as prefix_budget
from .tracing import TEXTS

SERVER_MODULES = (
    "llama_cpp",
    "fastapi",
    "uvicorn",
    "sse_starlette",
    "prometheus_client",
    "anthropic",
)
"""What the worker imports beyond moepack (looked up, not imported: that is slow)."""
MAX_BODY = 8 << 20
"""The largest request body the server takes by default (``guard.MAX_BODY``)."""
CONTEXT_STEP = 256
"""llama.cpp makes a context of a multiple of this many tokens (``llama-context.cpp``:
``cparams.n_ctx = GGML_PAD(cparams.n_ctx, 256)``)."""
TRACE_MAX_BYTES = 1 << 30
TEXT_MAX_BYTES = 64 << 20
"""Request text a trace's header holds at most (the header is JSON, read capped)."""


@dataclass(frozen=True)
class ServeOptions:
    """How the server runs.

    ``aliases``: the model's names in the API, plain names and globs (``names``; default:
    the file's name without ``.gguf``).
    ``chat_format``: llama-cpp-python's chat format (default: the model's own template,
    else its fallback). ``prefetch``: the expert prefetcher's options (None: llama.cpp's own
    page faults; ``AutoStream``, the default: the prefetcher where the model does not fit). ``spin``: ``GOMP_SPINCOUNT`` as ``RunOptions.spin``. ``trace_max_bytes``:
    what the routing spool (and request text) may hold; ``trace_text``: keep each request's
    prompt and generated text in the trace. ``lookahead_trace``: a trace to fit the
    trace-learned lookahead predictors on. ``watch_routing``: capture every layer's routing
    for the dashboard's heat map without a trace (a traced server has it anyway; capture
    costs a Python call per MoE layer and pass, and keeps the prefetcher's callback on for a
    model that is wholly cached). ``placement``: where llama.cpp keeps the weights
    (``RunOptions.placement``). ``max_body``: the largest request body taken
    (bytes; larger is 413); ``max_prompt_tokens``: the most tokens a prompt may have (None:
    the context; a prompt whose bytes alone show it longer is 413 before it is tokenised).
    ``max_queue``: how many requests may wait for the model (None: any; the next is 429).
    ``api_key``: the key both APIs then require (it reaches the worker
    in its environment, never in the job file). ``prefix_cache``: bytes of KV state kept
    of recent prompts across requests (0: off; None: 2 GiB or an eighth of the run's memory,
    the lesser; ``prefixcache.budget_bytes``)."""

    host: str = "127.0.0.1"
    port: int = 8000
    aliases: tuple[str, ...] = ()
    chat_format: str | None = None
    n_ctx: int = 4096
    threads: int | None = None
    threads_batch: int | None = None
    batch: int = 512
    prefetch: Prefetch = field(default_factory=AutoStream)
    memory: int | str = "auto"  # what the whole server may take (RunOptions.memory)
    spin: int | None = None
    trace_max_bytes: int = TRACE_MAX_BYTES
    trace_text: bool = False
    lookahead_trace: str | None = None
    watch_routing: bool = False
    placement: str = "auto"
    max_body: int = MAX_BODY
    max_prompt_tokens: int | None = None
    max_queue: int | None = None
    api_key: str | None = field(default=None, repr=False)
    draft: DraftOptions = DraftOptions()
    prefix_cache: int | None = None

    def validate(self) -> None:
        if self.placement not in PLACEMENTS:
            raise BadInput(f"`placement` is one of {', '.join(PLACEMENTS)}, not {self.placement!r}")
        if not 0 <= self.port <= 65535:
            raise BadInput(f"`port` is 0 to 65535, not {self.port}")
        if (self.threads is not None and self.threads < 1) or self.batch < 1:
            raise BadInput("`threads` and `batch` must be >= 1")
        if self.n_ctx < CONTEXT_STEP:
            raise BadInput(
                f"`n_ctx` must be at least {CONTEXT_STEP} tokens, not {self.n_ctx}: llama.cpp "
                f"makes a context of a multiple of {CONTEXT_STEP} tokens"
            )
        if isinstance(self.memory, str) and self.memory != "auto":
            raise BadInput(f"`memory` is a byte count or auto, not {self.memory!r}")
        if isinstance(self.memory, int) and self.memory <= 0:
            raise BadInput(f"`memory` must be positive, got {self.memory}")
        if self.threads_batch is not None and self.threads_batch < 1:
            raise BadInput(f"`threads_batch` must be >= 1, got {self.threads_batch}")
        if self.trace_max_bytes < 1:
            raise BadInput(f"`trace_max_bytes` must be positive, got {self.trace_max_bytes}")
        if self.spin is not None and self.spin < 0:
            raise BadInput(f"`spin` must be >= 0, got {self.spin}")
        for alias in self.aliases:
            if not alias.strip() or not alias.isprintable():
                raise BadInput(f"`alias` must be printable and not empty, got {alias!r}")
        if self.max_queue is not None and self.max_queue < 0:
            raise BadInput(f"`max_queue` must be 0 or more, got {self.max_queue}")
        if self.prefix_cache is not None and self.prefix_cache < 0:
            raise BadInput(f"`prefix_cache` must be 0 (off) or more bytes, got {self.prefix_cache}")
        if self.max_body < 1:
            raise BadInput(f"`max_body` must be positive, got {self.max_body}")
        n_ctx = served_context(self.n_ctx)
        if self.max_prompt_tokens is not None and not 1 <= self.max_prompt_tokens <= n_ctx:
            raise BadInput(
                f"`max_prompt_tokens` must be 1 to `n_ctx` ({n_ctx}), got {self.max_prompt_tokens}"
            )
        if isinstance(self.prefetch, AutoStream):
            self.prefetch.options.validate()
        elif self.prefetch is not None:
            self.prefetch.validate()
        if self.api_key is not None and (
            not self.api_key.strip() or not self.api_key.isprintable()
        ):
            raise BadInput("`api_key` must be printable and not empty")
        self.draft.validate()

    def to_job(self) -> dict[str, Any]:
        d = asdict(self)
        del d["api_key"]
        assert not isinstance(self.prefetch, AutoStream), "resolved by serve_model"
        d["prefetch"] = asdict(self.prefetch) if self.prefetch is not None else None
        return d


@dataclass(frozen=True)
class Listening:
    """Where the server answers (the worker's ``listening`` event)."""

    url: str
    host: str
    port: int
    alias: str
    llama_cpp: str
    callback: str | None
    engine: str = "llama.cpp"  # what runs the experts (choice.StreamingChoice.engine)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ServeResult:
    """What a server did until it stopped (``serve_model`` raises ``KeyboardInterrupt`` when an
    interrupt stopped it, which is how it stops; this is what it returns otherwise)."""

    model: Path
    listening: Listening | None
    requests: int
    phases: dict[str, Any]
    trace: Path | None
    traced_requests: int
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": str(self.model),
            "listening": self.listening.to_json() if self.listening else None,
            "requests": self.requests,
            "phases": self.phases,
            "trace": str(self.trace) if self.trace else None,
            "traced_requests": self.traced_requests,
            "warnings": self.warnings,
        }


def served_context(n_ctx: int) -> int:
    """The context llama.cpp makes of ``n_ctx`` tokens asked: the next multiple of
    ``CONTEXT_STEP``. The server asks for that itself: llama-cpp-python sizes its token and
    logit arrays by the number it is given and checks prompts against llama.cpp's, so a prompt
    between the two failed in numpy ("could not broadcast input array")."""
    return -(-n_ctx // CONTEXT_STEP) * CONTEXT_STEP


def serve_model(
    model: str | os.PathLike[str],
    options: ServeOptions = ServeOptions(),
    *,
    trace_out: str | os.PathLike[str] | None = None,
    on_listening: Callable[[Listening], None] | None = None,
    on_warning: Callable[[str], None] | None = None,
    on_request: Callable[[dict[str, Any]], None] | None = None,
    on_note: Callable[[str], None] | None = None,
) -> ServeResult:
    """Serve ``model`` (see the module docstring) until interrupted; ``trace_out`` receives
    the routing of every request (``logits_all`` on: llama.cpp then computes the last layer
    for every prompt token); ``on_request`` each answered request's summary
    (``requestlog.RequestRecord.summary``); ``on_note`` the line saying the prefetcher was
    chosen unasked (``choice``)."""
    path = Path(model)
    options.validate()
    options = replace(options, n_ctx=served_context(options.n_ctx))
    _identities, n_expert = check_model(path)
    cache = prefix_budget(options)  # its size settled once: the plan and the worker agree
    settings = resolve_run(  # serve decodes at the default count: no tuner
        path,
        options.prefetch,
        threads=options.threads,
        threads_batch=options.threads_batch,
        memory=options.memory,
        n_ctx=options.n_ctx,
        n_batch=options.batch,
        tune=False,
        prefix_cache=cache,
    )
    streaming, threads = settings.streaming, settings.fault_threads
    if streaming.note and on_note is not None:
        on_note(streaming.note)
    prefetch = streaming.prefetch
    options = replace(
        options,
        threads=settings.threads,
        threads_batch=settings.threads_batch,
        prefetch=prefetch,
        prefix_cache=cache,
    )
    check_pager_budget(path, prefetch, threads)
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise BadInput(
            f"the server is not installed ({', '.join(missing)}): pip install 'moepack[serve]'"
        )
    if options.lookahead_trace is not None:
        check_lookahead_trace(options.lookahead_trace, path)
    if options.draft.model is not None:
        check_draft_model(options.draft.model, path)
    dest: Path | None = None
    if trace_out is not None and options.draft.enabled:
        raise BadInput(
            "a served trace records every position llama.cpp computes, rejected drafts too: "
            "trace without `draft`"
        )
    if trace_out is not None:
        dest = check_destination(trace_out, [path])
        output_format(dest)  # an unknown extension fails before llama.cpp runs
    names = ModelNames.of(
        options.aliases,
        path.name[: -len(".gguf")] if path.name.endswith(".gguf") else path.name,
    )
    warned = Warnings(on_warning)
    segments: list[dict[str, int]] = []
    listening: list[Listening] = []

    def on_event(event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "listening":
            where = Listening(
                str(event["url"]),
                str(event["host"]),
                int(event["port"]),
                str(event["alias"]),
                str(event["llama_cpp"]),
                event.get("callback"),
                streaming.engine,
            )
            listening.append(where)
            if on_listening and len(listening) == 1:  # a worker started again: said once
                on_listening(where)
        elif kind == "request":
            if on_request:
                on_request({k: v for k, v in event.items() if k != "event"})
        elif kind == "segment":
            segments.append(
                {
                    k: int(event[k])
                    for k in ("prompt", "start", "prefill", "decode", "reused", "prompt_tokens")
                }
            )

    where = dest.parent if dest is not None else None
    account = StopAccount()
    sock = listen(options.host, options.port)  # before any model loads: a port in use is one line
    try:
        with scratch_folder(dest.name if dest else "serve", near=where) as folder:
            job = {
                "model": str(path),
                "alias": names.primary,
                "names": names.to_job(),
                "options": options.to_job(),
                "trace": dest is not None,
                "spool": str(folder),
                "id_dtype": id_dtype_for(n_expert).name,
                "socket": sock.fileno(),
            }
            restarts = Restarts()

            def on_any(event: dict[str, Any]) -> None:
                account.see(event)
                on_event(event)

            while True:
                try:
                    outcome = run_worker(
                        "moepack.serve.worker",
                        job,
                        env={
                            **openmp_env(path, options.prefetch is not None, options.spin),
                            **({API_KEY_ENV: options.api_key} if options.api_key else {}),
                        },
                        folder=folder,
                        model=path,
                        on_event=on_any,
                        on_warning=warned,
                        pass_fds=(sock.fileno(),),
                    )
                    break
                except WorkerDied as e:
                    if not listening or not restarts.allow():  # it never served: the model
                        raise
                    warned(
                        f"the server's worker died ({e.message.removeprefix(DIED)}); started "
                        f"it again on the same port ({restarts.count} of {RESTARTS} in "
                        f"{RESTART_WINDOW:g} s){_resumed(dest, segments)}"
                    )
                    job["resume"] = {
                        "tokens": sum(s["prefill"] + s["decode"] for s in segments),
                        "segments": len(segments),
                    }
                except KeyboardInterrupt:  # stopped at once: the whole requests are kept
                    if dest is not None and segments:
                        _save_trace(path, folder, segments, dest, options, listening)
                    raise Stopped(account.words(at_once=True)) from None
            saved = None
            if dest is not None and segments:
                saved = _save_trace(path, folder, segments, dest, options, listening)
    finally:
        sock.close()
    if outcome.interrupted:
        raise Stopped(account.words())
    done = outcome.done
    return ServeResult(
        model=path,
        listening=listening[0] if listening else None,
        requests=int(done["requests"]),
        phases=done["phases"],
        trace=saved,
        traced_requests=len(segments) if saved else 0,
        warnings=list(warned),
    )


DIED = "llama.cpp could not run this model: "
RESTARTS = 5
RESTART_WINDOW = 60.0


class Restarts:
    """A worker that died is started again, at most ``RESTARTS`` times in ``RESTART_WINDOW``
    seconds (past that, what kills it is not one unlucky request: the server ends)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    @property
    def count(self) -> int:
        return len(self.times)

    def allow(self) -> bool:
        now = time.monotonic()
        self.times = [t for t in self.times if now - t < RESTART_WINDOW]
        if len(self.times) >= RESTARTS:
            return False
        self.times.append(now)
        return True


def _resumed(dest: Path | None, segments: list[dict[str, int]]) -> str:
    if dest is None:
        return ""
    return f"; the trace keeps the {len(segments)} requests traced so far"


class StopAccount:
    """What the server did, for the line the command prints when it stops: the requests
    answered (every worker's, from their ``request`` events), and those the stop cut short
    or refused (``stop`` events)."""

    def __init__(self) -> None:
        self.answered = 0
        self.cut = 0
        self.refused = 0

    def see(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "request":
            self.answered += 1
        elif kind == "stop":
            if event.get("what") == "cut":
                self.cut += 1
            elif event.get("what") == "refused":
                self.refused += 1

    def words(self, at_once: bool = False) -> str:
        n = self.answered
        said = f"the server answered {n:,} request{'s' if n != 1 else ''}"
        if at_once:
            return said + " (stopped at once: requests in flight were cut off)"
        parts = []
        if self.cut:
            parts.append(f"{self.cut:,} cut short by the stop")
        if self.refused:
            parts.append(f"{self.refused:,} refused while stopping")
        return said + (f" ({', '.join(parts)})" if parts else "")


def _texts(folder: Path, requests: int) -> list[dict[str, Any]]:
    """The traced requests' text (``trace_text``), up to ``TEXT_MAX_BYTES``."""
    out: list[dict[str, Any]] = []
    size = 0
    try:
        with open(folder / TEXTS, encoding="utf-8") as fh:
            for line in fh:
                size += len(line)
                if size > TEXT_MAX_BYTES:
                    break
                item = json.loads(line)
                if int(item["request"]) < requests:
                    out.append(item)
    except (OSError, ValueError):
        return out
    return out


def _save_trace(
    model: Path,
    folder: Path,
    segments: list[dict[str, int]],
    out: Path,
    options: ServeOptions,
    listening: list[Listening],
) -> Path:
    """The requests' routing as a trace bound to ``model``: one prompt segment per request,
    written atomically from memory maps of the spool."""
    tokens = sum(s["prefill"] + s["decode"] for s in segments)
    prompts = [{k: s[k] for k in ("prompt", "start", "prefill", "decode")} for s in segments]
    with MoeModel(model) as m:
        n_expert = max(b.n_expert for b in m.blocks)
        blocks = m.run_block_indices
        shape = (tokens, len(blocks), m.top_k)
        serve: dict[str, Any] = {
            "requests": [
                {"prompt_tokens": s["prompt_tokens"], "reused": s["reused"]} for s in segments
            ],
            "trace_max_bytes": options.trace_max_bytes,
            "prefetch": asdict(options.prefetch) if options.prefetch else None,
        }
        if options.trace_text:
            serve["texts"] = _texts(folder, len(segments))
        engine = f"llama.cpp (llama-cpp-python {listening[0].llama_cpp})" if listening else None
        trace = RoutingTrace(
            ids=spooled(folder, "ids", id_dtype_for(n_expert), shape),
            n_expert=n_expert,
            segments=[PromptSegment(s["start"], s["prefill"], s["decode"]) for s in segments],
            block_map=list(blocks),
            model_fingerprint=m.fingerprint,
            provenance={
                "source": "moepack serve",
                "model": str(model),
                # the per-prompt segments in capture's form (capture.token_prompts reads them)
                "capture": {
                    "tool": "moepack serve",
                    "engine": engine,
                    "prompts": prompts,
                    "prompt_count": len(prompts),
                    "truncated": False,
                    "sampling": "as each request asked",
                    "threads": options.threads,
                },
                "serve": serve,
            },
        )
        save_trace(trace, out, inputs=tuple(m.shard_paths))
        del trace
    return out
