"""Runs inside a llama.cpp worker process (``child.run_worker``): llama-cpp-python's server on
one model, with the prefetcher, the meter, ``/metrics`` and the routing spool.

The listening socket is the parent's, inherited (``listening``: a worker started again after
one died serves on the same port); the worker sends ``listening`` (its URL) once uvicorn
accepts connections, ``segment`` after every traced request, ``stop`` for each request a stop
cut short or refused, and ``done`` when the server has stopped. Interrupts stay the worker
channel's (uvicorn installs no handlers of its own): the first one the parent passes on makes
uvicorn stop accepting, the generation in progress end at its next token and the requests
waiting for the model be refused (``stopping``), then the answers go out; the second ends
the worker at once (``Channel``). Completions stream through ``textstream``.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import uvicorn

from ..checkpoint.model import MoeModel
from ..llama.prefetcher.prefetch import ExpertRanges
from ..llama.prefetcher.streamer import StreamOptions
from ..llama.protocol.child import Channel, could_not_run, worker_main
from ..llama.runtime.draft import DraftOptions
from ..llama.runtime.draft_hook import drafting
from ..llama.runtime.hook import capturing, prefetching
from ..llama.runtime.placement import llama_placement, prefetch_unless_idle
from .anthropic_api import add_anthropic, shapes_with_anthropic
from .anthropic_request import AUTO_TOOLS
from .apikey import ENV as API_KEY_ENV
from .apikey import ApiKey
from .app import AppSettings, add_moepack, check_chat_format, create, pages
from .badhttp import shaped_protocol
from .checks import Limits, prompt_cap
from .dashboard import PAGES, add_dashboard
from .embedding import Embedder
from .listening import url_of
from .llamagrammar import Candidates, guard_samplers, vocabulary_of
from .meter import PHASES, Meter
from .metrics import ExpertResidency, RequestCounts, ServeCollector, registry_of
from .names import ModelNames
from .ollama_api import add_ollama, register_shape
from .ollama_models import OllamaProbe, facts_of
from .prefixcache import prefix_cache
from .queuelimit import QueueLimit
from .requestlog import RequestLog, RequestLogging
from .responses_api import add_responses
from .routingheat import RoutingHeat
from .schema_grammar import mend
from .stopping import Stopping
from .textstream import Completions
from .tracing import TraceSpool
from .validate import BodyChecks


class _Server(uvicorn.Server):
    """uvicorn, stopped by the worker channel's interrupts instead of its own handlers."""

    def __init__(
        self,
        config: uvicorn.Config,
        channel: Channel,
        on_started: Callable[[], None],
        on_stop: Callable[[], None],
    ) -> None:
        super().__init__(config)
        self.channel = channel
        self.on_started = on_started
        self.on_stop = on_stop

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_started()

    async def on_tick(self, counter: int) -> bool:
        if self.channel.stopping:
            self.on_stop()
            self.should_exit = True
        return await super().on_tick(counter)


def serve(job: dict[str, Any], channel: Channel) -> dict[str, Any]:
    """Load the model into llama-cpp-python's server and serve until interrupted."""
    import llama_cpp

    opts = job["options"]
    model = job["model"]
    check_chat_format(opts["chat_format"])
    with MoeModel(model) as m:  # closed before llama.cpp maps the file
        layout = ExpertRanges(m)
        blocks, k, shards = layout.blocks, m.top_k, list(m.shard_paths)
        fingerprint = str(m.fingerprint)
        n_expert = max(b.n_expert for b in m.blocks)
        ranges = [r for b in blocks for r in layout.whole_tensors(b)]
    trace_ids = None
    if opts["lookahead_trace"]:
        from ..trace.formats import load_trace

        trace_ids = np.asarray(load_trace(opts["lookahead_trace"]).ids)
    tracing = bool(job["trace"])
    draft = DraftOptions(**opts["draft"])
    opts["prefetch"] = prefetch_unless_idle(
        model, opts.get("placement", "auto"), opts["prefetch"], channel.warn
    )
    sock = socket.socket(fileno=int(job["socket"]))  # the parent's, inherited
    with ExitStack() as files:
        files.callback(sock.close)
        tracer = None
        if tracing:
            tracer = TraceSpool(
                files,
                Path(job["spool"]),
                blocks,
                k,
                job["id_dtype"],
                int(opts["trace_max_bytes"]),
                channel.send,
                channel.warn,
                text=bool(opts["trace_text"]),
                resume=job.get("resume"),
            )
        settings = AppSettings(
            model=model,
            alias=job["alias"],
            n_ctx=int(opts["n_ctx"]),
            threads=int(opts["threads"]),
            threads_batch=opts.get("threads_batch"),
            batch=int(opts["batch"]),
            chat_format=opts["chat_format"],
            # llama.cpp computes the last layer only for tokens whose logits are asked for;
            # drafts are sampled at every position of a verification pass
            logits_all=tracing or draft.enabled,
        )
        streaming = opts["prefetch"] is not None
        try:
            with llama_placement(model, opts.get("placement", "auto"), streaming=streaming):
                app, llm = create(settings)
        except ValueError as e:  # llama-cpp-python's "Failed to load model from file"
            raise could_not_run(str(e), model) from None
        files.callback(llm.close)
        if int(llm.n_ctx()) != settings.n_ctx:  # llama-cpp-python sizes its arrays by ours
            raise could_not_run(
                f"llama.cpp made a context of {llm.n_ctx()} tokens for the {settings.n_ctx} asked",
                model,
            )
        mend()  # the grammars of tool calls are JSON (before any request makes one)
        candidates = Candidates(llm)
        guard_samplers(llm, candidates)
        # the routing the server sees (traced, or watched for the dashboard's heat map)
        heat = None
        if tracing or opts.get("watch_routing"):
            heat = RoutingHeat(blocks, k, n_expert)
        on_route = _fan_out([h.on_route for h in (tracer, heat) if h is not None])
        hook = None
        if opts["prefetch"] is not None:
            hook = prefetching(
                llm,
                StreamOptions(**opts["prefetch"]),
                on_route=on_route,
                warn=channel.warn,
                lookahead_ids=trace_ids,
            )
            files.callback(hook.detach)
        elif on_route is not None:
            files.callback(capturing(llm, on_route).detach)
        drafts = None
        if draft.enabled:  # under the meter's wrappers: the meter sees what the drafts kept
            counts_of = hook.streamer.batch_counts if hook else None
            drafts = drafting(llm, draft, batch_counts=counts_of)
            files.callback(drafts.detach)
        # under the meter: what it saves and restores is the request's time
        prefixes = prefix_cache(llm, int(opts.get("prefix_cache", 0)))
        meter = Meter(llm, snapshot=hook.snapshot if hook else None, tracer=tracer)
        if drafts is not None:
            drafts.on_rejected = meter.uncount
        log = RequestLog(lambda summary: channel.send("request", **summary))
        meter.on_open, meter.on_finish = log.on_open, log.on_finish
        meter.install()
        limits = Limits(
            n_ctx=settings.n_ctx,
            max_prompt_tokens=int(opts["max_prompt_tokens"] or settings.n_ctx),
            logprobs=settings.logits_all,
        )
        stopping = Stopping(lambda: channel.stopping, lambda what: channel.send("stop", what=what))
        Completions(
            llm,
            admit=_admission(llm, limits, stopping),
            cut=stopping.cut,
            on_cut=stopping.on_cut,
            failed=stopping.failed,
        ).install()
        residency = ExpertResidency(shards, ranges)
        files.callback(residency.close)
        counts = RequestCounts()
        budget = hook.report()["cache"]["budget_bytes"] if hook else None
        collector = ServeCollector(
            meter,
            counts,
            residency,
            hook is not None,
            log=log,
            budget=budget,
            drafts=drafts.snapshot if drafts else None,
            moe_layers=len(blocks),
            pager=hook.streamer.pager_report if hook else None,
            prefix_cache=prefixes.snapshot if prefixes else None,
        )
        registry = registry_of(collector)
        names = (
            ModelNames.from_job(job["names"]) if "names" in job else ModelNames.of([], job["alias"])
        )
        requests = BodyChecks(vocabulary_of(llm, candidates), limits, names)
        shapes = register_shape(shapes_with_anthropic())
        routes = add_moepack(
            app,
            llm,
            requests,
            counts,
            registry,
            max_body=int(opts["max_body"]),
            shapes=shapes,
            names=names,
        )
        add_anthropic(app, llm, names, routes, requests.checks)
        add_responses(app, llm, names, routes, requests.checks)
        facts = facts_of(
            llm,
            [str(s) for s in shards],
            fingerprint,
            settings.n_ctx,
            llm.chat_format in AUTO_TOOLS,
        )
        embedder = Embedder(
            llm, limits.max_prompt_tokens, admit=stopping.admit, aborted=stopping.requested
        )
        add_ollama(app, llm, names, routes, requests.checks, facts, embedder)
        mode = opts["prefetch"]["mode"] if opts["prefetch"] is not None else None
        about = {"alias": job["alias"], "prefetch": mode, "routing": heat is not None}
        add_dashboard(app, registry, heat, about)
        routes.update(pages(["/metrics.json", *PAGES]))
        if opts.get("max_queue") is not None:
            app.add_middleware(
                QueueLimit,
                max_queue=int(opts["max_queue"]),
                routes=routes,
                counts=counts,
                shapes=shapes,
            )
        key = os.environ.pop(API_KEY_ENV, None)
        if key:
            app.add_middleware(ApiKey, key=key)
        app.add_middleware(OllamaProbe)  # GET / from an Ollama client: "Ollama is running"
        app.add_middleware(RequestLogging, log=log)  # outermost: it sees every answer
        host, port, url = url_of(sock)

        def started() -> None:
            channel.send(
                "listening",
                url=url,
                host=host,
                port=port,
                alias=job["alias"],
                llama_cpp=llama_cpp.__version__,
                callback=hook.streamer.callback.kind if hook else None,
            )

        if not channel.stopping:  # an interrupt while the model loaded: nothing to serve
            config = uvicorn.Config(
                app,
                log_level="warning",
                access_log=False,
                timeout_graceful_shutdown=None,
                http=shaped_protocol(shapes),  # what h11 refuses, in the API's shape too
            )
            _Server(config, channel, started, lambda: stopping.engage(llm)).run(sockets=[sock])
        meter.close()
        totals, _last, prefetch, _lp, generations = meter.read()
        return {
            "url": url,
            "requests": generations,
            "answered": [[p, c, n] for (p, c), n in sorted(counts.answered.items())],
            "phases": {p: totals[p].to_json() for p in PHASES},
            "prefetch": prefetch,
            "stream": hook.report() if hook else None,
            "trace": tracer.summary() if tracer else None,
            "draft": drafts.snapshot() if drafts else None,
            "cut_short": stopping.cut_short,
            "refused": stopping.refused,
        }


def _admission(llm: Any, limits: Limits, stopping: Stopping) -> Callable[[Any], None]:
    """What every completion passes before it runs: the server is not stopping, and its
    prompt is within ``--max-prompt-tokens`` (counted here, once the guard's bound by bytes
    let it through: tokenising it is then bounded work)."""

    def admit(prompt: Any) -> None:
        stopping.admit()
        if limits.max_prompt_tokens >= limits.n_ctx:
            return  # the context's own check (llama-cpp-python's 400) is the bound
        if isinstance(prompt, str):
            n = len(llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True))
        else:
            n = len(prompt)
        prompt_cap(n, limits)

    return admit


def _fan_out(
    handlers: list[Callable[[int, np.ndarray], None]],
) -> Callable[[int, np.ndarray], None] | None:
    """One ``on_route`` telling every handler (None: no one listens)."""
    if not handlers:
        return None
    if len(handlers) == 1:
        return handlers[0]

    def on_route(block: int, ids: np.ndarray) -> None:
        for handler in handlers:
            handler(block, ids)

    return on_route


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:], serve))
