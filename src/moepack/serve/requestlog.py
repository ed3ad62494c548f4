"""One record per answered API request: what it asked of the model and how the model did.

The HTTP side knows a request (its API, route, status, why it stopped); the meter knows the
generations llama.cpp ran (prompt, reused prefix, tokens, time, bytes, hits). They meet through
a context variable: ``RequestLogging`` (an ASGI middleware) makes the request's record current
before the application runs, and the meter's ``on_open`` — called in the thread that runs the
generation, which the application starts with a copy of the request's context (Starlette's
``run_in_threadpool``, a streaming publisher task) — files the generation under it. A record
is summed up once both the response is over and every generation it ran is closed (a client
that leaves mid-stream leaves its generation to be closed later), then handed to ``emit``:
the worker sends it to the parent, where the command prints one line (``line``) or one JSON
object. The time to first token is the client's: from the request's arrival (waiting for the
model included) to the first token the model gave.
"""

from __future__ import annotations

import itertools
import re
import threading
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .meter import PHASES, PhaseTotals, ServedGeneration

MB = 1e6
WATCHERS = ("/dashboard", "/metrics")
"""Routes a watcher polls (the page asks every second), and ``/``: not logged."""
STREAMS = (b"text/event-stream", b"application/x-ndjson")
"""Streamed answers: server-sent events (OpenAI, Anthropic), JSON lines (Ollama)."""
_FINISH = re.compile(rb'"finish_reason"\s*:\s*"(\w+)"')


@dataclass
class RequestRecord:
    """One request, from its arrival to its summary."""

    id: str
    api: str
    route: str
    method: str
    start_ns: int = field(default_factory=perf_counter_ns)
    status: int = 0
    stream: bool = False
    stop_reason: str | None = None
    generations: list[ServedGeneration] = field(default_factory=list)
    ended_ns: int | None = None
    open: int = 0  # generations not closed yet

    def summary(self) -> dict[str, Any]:
        """The figures of the log line (None where the request ran no generation)."""
        out: dict[str, Any] = {
            "id": self.id,
            "api": self.api,
            "route": self.route,
            "method": self.method,
            "status": self.status,
            "stream": self.stream,
            "seconds": ((self.ended_ns or perf_counter_ns()) - self.start_ns) / 1e9,
            "prompt_tokens": None,
            "reused_tokens": None,
            "generated_tokens": None,
            "ttft_seconds": None,
            "decode_tokens_per_second": None,
            "decode_mb_per_token": None,
            "expert_hit_ratio": None,
            "stop_reason": self.stop_reason,
        }
        if not self.generations:
            return out
        first = self.generations[0]
        phases = {p: PhaseTotals() for p in PHASES}
        hits = experts = 0.0
        for gen in self.generations:
            for p in PHASES:
                t, g = phases[p], gen.phases[p]
                t.tokens += g.tokens
                t.ns += g.ns
                t.read_bytes += g.read_bytes
                t.major_faults += g.major_faults
                t.cpu_ns += g.cpu_ns
            hits += gen.prefetch.get("demand_hits", 0.0)
            experts += gen.prefetch.get("demand_experts", 0.0)
        decode = phases["decode"]
        out["prompt_tokens"] = len(first.prompt)
        # the prefix the previous request shared (llama-cpp-python keeps it) or the prefix
        # cache restored: not computed again
        out["reused_tokens"] = max(0, len(first.prompt) - first.phases["prefill"].tokens)
        out["generated_tokens"] = sum(len(g.generated) for g in self.generations)
        if first.first_token_ns is not None:
            out["ttft_seconds"] = (first.first_token_ns - self.start_ns) / 1e9
        if decode.tokens:
            out["decode_tokens_per_second"] = decode.tokens_per_second
            out["decode_mb_per_token"] = decode.per_token(decode.read_bytes) / MB
        if experts:
            out["expert_hit_ratio"] = hits / experts
        return out


CURRENT: ContextVar[RequestRecord | None] = ContextVar("moepack_request", default=None)
"""The request whose application code runs in this context."""


def current() -> RequestRecord | None:
    return CURRENT.get()


class RequestLog:
    """The records of one server, and the time-to-first-token figures ``/metrics`` shows."""

    def __init__(self, emit: Callable[[dict[str, Any]], None]) -> None:
        self.emit = emit
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.ttft_last: float | None = None
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.logged = 0
        self.prompt_tokens = 0  # of the requests logged, and of them reused
        self.reused_tokens = 0

    def begin(self, api: str, route: str, method: str) -> RequestRecord:
        return RequestRecord(f"req_{next(self._ids)}", api, route, method)

    def on_open(self, gen: ServedGeneration) -> None:
        """The meter opened ``gen``: file it under the current request."""
        rec = CURRENT.get()
        if rec is None:
            return
        with self._lock:
            rec.generations.append(gen)
            rec.open += 1
            gen.owner = rec

    def on_finish(self, gen: ServedGeneration) -> None:
        """The meter closed ``gen``: its request is summed up if its response is over too."""
        rec = gen.owner
        if not isinstance(rec, RequestRecord):
            return
        with self._lock:
            rec.open -= 1
            ready = rec.open == 0 and rec.ended_ns is not None
        if ready:
            self._done(rec)

    def end(self, rec: RequestRecord) -> None:
        """The response is over (sent, or the client left)."""
        with self._lock:
            rec.ended_ns = perf_counter_ns()
            ready = rec.open == 0
        if ready:
            self._done(rec)

    def _done(self, rec: RequestRecord) -> None:
        summary = rec.summary()
        ttft = summary["ttft_seconds"]
        with self._lock:
            self.logged += 1
            self.prompt_tokens += summary["prompt_tokens"] or 0
            self.reused_tokens += summary["reused_tokens"] or 0
            if ttft is not None:
                self.ttft_last = ttft
                self.ttft_sum += ttft
                self.ttft_count += 1
        self.emit(summary)

    def reuse(self) -> tuple[int, int]:
        """(prompt tokens of the requests logged, of them reused: the log's own counts)."""
        with self._lock:
            return self.prompt_tokens, self.reused_tokens

    def ttft(self) -> tuple[float, float]:
        """(the last request's time to first token, the mean over the server's life), s."""
        with self._lock:
            mean = self.ttft_sum / self.ttft_count if self.ttft_count else 0.0
            return self.ttft_last or 0.0, mean


def api_of(path: str) -> str:
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/api/"):
        return "ollama"
    if path.startswith("/v1/") or path.startswith("/extras/"):
        return "openai"
    return "other"


def logged(scope: Scope) -> bool:
    """Whether a request gets a line: every API request, not the watchers' polls."""
    path = str(scope["path"])
    if scope["method"] == "GET" and (path == "/" or path.startswith(WATCHERS)):
        return False
    return path.startswith(("/v1/", "/api/")) or scope["method"] == "POST"


class RequestLogging:
    """The ASGI middleware that keeps a record per request (see the module docstring). An
    OpenAI response's ``finish_reason`` is read from the bytes it sends (the last one seen);
    the Anthropic routes set their ``stop_reason`` on the current record themselves. Every
    logged response carries its record's id in a ``request-id`` header, as Anthropic's do."""

    def __init__(self, app: ASGIApp, *, log: RequestLog) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not logged(scope):
            await self.app(scope, receive, send)
            return
        path = str(scope["path"])
        rec = self.log.begin(api_of(path), path, str(scope["method"]))
        token = CURRENT.set(rec)
        reason: list[str] = []
        ended = False

        def end() -> None:
            nonlocal ended
            if ended:
                return
            ended = True
            if rec.status == 0:
                rec.status = 500
            if rec.stop_reason is None and reason:
                rec.stop_reason = reason[0]
            self.log.end(rec)

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                rec.status = int(message["status"])
                headers = list(message.get("headers", []))
                for key, value in headers:
                    if key.lower() == b"content-type":
                        rec.stream = value.split(b";")[0].strip() in STREAMS
                message = {**message, "headers": [*headers, (b"request-id", rec.id.encode())]}
            elif message["type"] == "http.response.body" and rec.api == "openai":
                found = _FINISH.findall(message.get("body", b""))
                if found:
                    reason[:] = [found[-1].decode()]
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                # recorded before the client has its last byte: a stop that follows the answer
                # at once still counts it
                end()
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            CURRENT.reset(token)
            end()


def _num(value: float | None, fmt: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{unit}"


def line(s: dict[str, Any]) -> str:
    """The human line of a summary (``serve`` prints it on stderr)."""
    head = f"{s['id']} {s['api']} {s['method']} {s['route']} {s['status']}"
    if s["prompt_tokens"] is None:
        return f"{head} ({s['seconds']:.2f} s)"
    hit = s["expert_hit_ratio"]
    parts = [
        f"prompt {s['prompt_tokens']} ({s['reused_tokens']} reused)",
        f"generated {s['generated_tokens']}",
        f"ttft {_num(s['ttft_seconds'], '.2f', ' s')}",
        f"decode {_num(s['decode_tokens_per_second'], '.1f', ' tok/s')}",
        f"{_num(s['decode_mb_per_token'], '.2f', ' MB/tok')}",
        f"hit {_num(None if hit is None else 100 * hit, '.0f', '%')}",
        f"stop {s['stop_reason'] or '-'}",
    ]
    return f"{head}: {', '.join(parts)} ({s['seconds']:.2f} s)"
