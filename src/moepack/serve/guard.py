"""The server's front door: every request is checked here before any route sees it, and every
error leaves in the shape of the API it was made to (an ASGI middleware, outermost).

What it refuses, each answered at once without the application running:

- a path the server does not serve: 404; a method a path does not take: 405 with ``Allow``
  (FastAPI would answer both as ``{"detail": …}``);
- a body that is not declared JSON (``Content-Type`` missing, ``text/plain``, a form): 415;
- a body larger than ``max_body`` bytes: 413, from its ``Content-Length`` before a byte of it
  is read, else as soon as what arrived passes the cap;
- a body that is not JSON, has a number JSON cannot hold (``NaN``, ``1e999``), nests deeper
  than ``MAX_DEPTH`` levels, or holds a lone UTF-16 surrogate (``"\\ud800"``, which no
  UTF-8 encoder takes): 400;
- whatever the route's own check (``validate``, ``anthropic_api``) refuses, in its words (run
  off the event loop for a body of 64 KiB or more).

A request let through runs with its token budget current (``budget``; ``Route.budget`` reads
it from the body).

Responses are watched on their way out: an error the application words as FastAPI does
(``{"detail": …}``: 404, 405, 422) or a failure of its own (5xx: llama-cpp-python puts the
exception's text, paths and traceback lines included, in the body) is re-worded; a
``Refused`` raised deep in the application (in llama.cpp's thread, alone or in the group of
exceptions a task group raises) is answered with its ``ApiProblem``; an exception that escapes
the application is a 500 that says nothing of it.
No traceback text ever leaves the server.

Completion routes (``Route.counted``) are counted in flight and answered, per status.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .budget import budgeted
from .metrics import RequestCounts
from .shapes import ApiProblem, Refused, Shapes, send_json

MAX_BODY = 8 << 20
MAX_DEPTH = 64
PARSED = "moepack.json"
"""The scope key the parsed (and checked) JSON body is left under for the layers inside."""
_THREAD_BYTES = 64 << 10  # a body this large is parsed off the event loop
FAILED = ApiProblem(500, "the server failed on this request", kind="server_error")

Check = Callable[[Any], "tuple[ApiProblem | None, Any]"]
"""A route's check of its parsed body: (a refusal or None, the body to pass on)."""


@dataclass(frozen=True)
class Route:
    """A path the server answers: its methods, the check of its JSON body (POST), whether its
    requests are counted in ``/metrics`` (and queue for the model: ``queuelimit``), and where
    its body says how many tokens it may sample (``budget``: the request's token budget)."""

    path: str
    methods: frozenset[str]
    check: Check | None = None
    counted: bool = False
    budget: Callable[[Any], int | None] | None = None


class Guard:
    """The middleware (see the module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        routes: Mapping[str, Route],
        shapes: Shapes,
        counts: RequestCounts,
        max_body: int = MAX_BODY,
    ) -> None:
        self.app = app
        self.routes = routes
        self.shapes = shapes
        self.counts = counts
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        route = self.routes.get(path)
        if route is None:
            await self._answer(
                send,
                path,
                ApiProblem(
                    404, f"Invalid URL ({method} {path})", kind="not_found_error", code="not_found"
                ),
            )
            return
        allowed = route.methods | ({"HEAD"} if "GET" in route.methods else set())
        if method not in allowed:
            await self._answer(
                send,
                path,
                ApiProblem(
                    405,
                    f"{path} does not take {method} (it takes {', '.join(sorted(allowed))})",
                    code="method_not_allowed",
                    headers=(("allow", ", ".join(sorted(allowed))),),
                ),
            )
            return
        if not route.counted:
            await self._inner(scope, receive, send, route)
            return
        self.counts.started()
        status = [500]

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self._inner(scope, receive, counted, route)
        finally:
            self.counts.finished(path, status[0])

    async def _inner(self, scope: Scope, receive: Receive, send: Send, route: Route) -> None:
        path = scope["path"]
        tokens = None
        if scope["method"] == "POST":
            problem, body = await self._body(scope, receive)
            if problem is None:
                problem, data = await _parse(body)
                if problem is None and route.check is not None and body is not None:
                    problem, checked = await _checked(route.check, data, len(body))
                    if problem is None and checked is not data:
                        body = json.dumps(checked).encode()
                        data = checked
            if problem is not None:
                await self._answer(send, path, problem)
                return
            if body is None:  # the client left before its body arrived
                return
            scope = dict(scope)
            scope[PARSED] = data
            receive = _replayed(body, receive)
            tokens = route.budget(data) if route.budget is not None else None
        with budgeted(tokens):
            await self._run(scope, receive, send)

    async def _body(self, scope: Scope, receive: Receive) -> tuple[ApiProblem | None, bytes | None]:
        """The whole body (None: the client left), or why it is refused before it is read."""
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if kind != b"application/json" and not kind.endswith(b"+json"):
            said = kind.decode("latin-1") or "none"
            return ApiProblem(
                415,
                f"the request body must be JSON (Content-Type: application/json), not {said}",
                code="unsupported_media_type",
            ), None
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                return ApiProblem(400, "Content-Length is not a number"), None
            if int(declared) > self.max_body:
                return self._too_large(int(declared)), None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return self._too_large(None), None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return None, b"".join(chunks)

    def _too_large(self, size: int | None) -> ApiProblem:
        have = f"{size:,} bytes" if size is not None else "more"
        return ApiProblem(
            413,
            f"the request body is {have}; this server takes at most "
            f"{self.max_body:,} bytes (--max-body)",
            code="request_too_large",
        )

    async def _run(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The application, its error responses re-worded (see the module docstring): an
        error response is held whole until the application returns, since Starlette answers
        an exception with its own plain 500 before it raises it on."""
        path = scope["path"]
        held: Message | None = None  # an error response's start
        parts: list[bytes] = []
        complete = False  # the held error response's body is all there
        sent_start = sent_end = False

        async def watched(message: Message) -> None:
            nonlocal held, complete, sent_start, sent_end
            if message["type"] == "http.response.start":
                if int(message["status"]) >= 400 and not _is_event_stream(message):
                    held = message
                    return
                sent_start = True
            elif message["type"] == "http.response.body" and held is not None:
                parts.append(message.get("body", b""))
                complete = not message.get("more_body", False)
                return
            elif message["type"] == "http.response.body":
                sent_end = not message.get("more_body", False)
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if sent_start:  # a response under way: nothing can be said now
                if not sent_end:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            refused = Refused.within(exc)
            if refused is not None:
                await self._answer(send, path, refused.problem)
                return
            if held is None or not complete:
                await self._answer(send, path, FAILED)
                return
        if held is not None:
            await self._reworded(send, path, held, b"".join(parts))

    async def _reworded(self, send: Send, path: str, start: Message, body: bytes) -> None:
        status = int(start["status"])
        problem = reworded(status, body)
        if problem is None:
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        extra = tuple(
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in start.get("headers", [])
            if k.lower() in (b"allow", b"retry-after")
        )
        if extra and not problem.headers:
            problem = ApiProblem(
                problem.status, problem.message, problem.param, problem.code, problem.kind, extra
            )
        await self._answer(send, path, problem)

    async def _answer(self, send: Send, path: str, problem: ApiProblem) -> None:
        await send_json(send, problem.status, self.shapes.render(path, problem), problem.headers)


def reworded(status: int, body: bytes) -> ApiProblem | None:
    """The ``ApiProblem`` an error response of the application stands for (None: it is in
    OpenAI's shape and says nothing of the server's insides; it goes out as it is, unless
    the path's API words errors otherwise — then it is re-shaped too)."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    error = data.get("error") if isinstance(data, dict) and len(data) == 1 else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        refused = Refused.parse(error["message"])
        if refused is not None:
            return refused
    if status >= 500:
        return FAILED
    if isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}:
        return ApiProblem(
            status, str(error["message"]), error["param"], error["code"], str(error["type"])
        )
    if isinstance(data, dict) and "detail" in data:
        return _from_detail(status, data["detail"])
    return None


def _from_detail(status: int, detail: Any) -> ApiProblem:
    """FastAPI's ``{"detail": …}``: a string, or request validation's list of errors."""
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):
        first = detail[0]
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        where = ".".join(loc) or None
        text = str(first.get("msg", "invalid request"))
        return ApiProblem(
            400 if status == 422 else status,
            f"{where}: {text}" if where else text,
            where,
            str(first.get("type")) if first.get("type") else None,
        )
    kinds = {404: "not_found_error", 405: "invalid_request_error"}
    return ApiProblem(status, str(detail), kind=kinds.get(status, "invalid_request_error"))


# -- the body ----------------------------------------------------------------------------------


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:32]} is too large for a double")
    return value


def parse_json(body: bytes, max_depth: int = MAX_DEPTH) -> tuple[ApiProblem | None, Any]:
    """The body as JSON, or why it is refused (see the module docstring)."""
    if not body.strip():
        return ApiProblem(400, "the request body is empty; it must be a JSON object"), None
    try:
        data = json.loads(body, parse_constant=_constant, parse_float=_finite)
    except RecursionError:
        return _too_deep(max_depth), None
    except UnicodeDecodeError:
        return ApiProblem(400, "the request body is not UTF-8"), None
    except ValueError as e:
        return ApiProblem(400, f"the request body is not valid JSON ({e})"), None
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth > max_depth:
                return _too_deep(max_depth), None
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str) and not _encodable(key):
                    return _surrogate(), None
                stack.append((item, depth + 1))
        elif isinstance(value, str) and not _encodable(value):
            return _surrogate(), None
    return None, data


async def _parse(body: bytes | None) -> tuple[ApiProblem | None, Any]:
    if body is None:
        return None, None
    if len(body) < _THREAD_BYTES:
        return parse_json(body)
    return await anyio.to_thread.run_sync(parse_json, body)


async def _checked(check: Check, data: Any, size: int) -> tuple[ApiProblem | None, Any]:
    """A route's check of its body, off the event loop for a large one (its grammars are
    parsed, its schemas converted: work that grows with the body)."""
    if size < _THREAD_BYTES:
        return check(data)
    return await anyio.to_thread.run_sync(check, data)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _too_deep(depth: int) -> ApiProblem:
    return ApiProblem(400, f"the request body nests deeper than {depth} levels")


def _surrogate() -> ApiProblem:
    return ApiProblem(
        400, "the request body holds a lone UTF-16 surrogate (such as \\ud800), which is not text"
    )


def _is_event_stream(start: Message) -> bool:
    for key, value in start.get("headers", []):
        if key.lower() == b"content-type":
            return bool(value.split(b";")[0].strip() == b"text/event-stream")
    return False


def _replayed(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the body read already, then the client's own messages (so the
    application still hears a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
