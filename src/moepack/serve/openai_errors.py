"""A completion request's failure answered in the OpenAI error shape, streamed or not (an ASGI
middleware inside the guard, in front of llama-cpp-python's completion routes).

The guard (``guard``) and the checks (``validate``) refuse bad requests before the
application runs; what is left is a request that fails while it runs. llama-cpp-python's
routes answer a context overflow of a plain request in OpenAI's shape themselves
(``RouteErrorHandler``), but a streamed request that fails before its first event (a prompt
longer than the context) has begun its SSE response already, so the client would read an
empty stream. Here the start of an event stream is held until its first event, and a
failure before it is answered as a plain request's would be (``RouteErrorHandler``'s own
wording through ``describe``, so the status and text are the server's; a ``Refused`` — found
in the group of exceptions sse-starlette's task group raises too — goes on to the guard, which
answers its ``ApiProblem``); a failure after it ends the stream with an ``error`` event, which
the OpenAI clients raise.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .guard import FAILED, PARSED
from .shapes import ApiProblem, Refused, error_object, send_json

Describe = Callable[[Exception, BaseModel | None], ApiProblem]


class OpenAIErrors:
    """The middleware (see the module docstring). ``requests``: path -> the request type of
    its body (the guard parsed and checked it); ``describe``: an exception -> the
    ``ApiProblem`` the application would answer it with."""

    def __init__(
        self, app: ASGIApp, *, requests: dict[str, type[BaseModel]], describe: Describe
    ) -> None:
        self.app = app
        self.requests = requests
        self.describe = describe

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = self.requests.get(scope["path"])
        if scope["type"] != "http" or scope["method"] != "POST" or kind is None:
            await self.app(scope, receive, send)
            return
        try:
            parsed: BaseModel | None = kind.model_validate(scope.get(PARSED))
        except ValidationError:  # checked by the guard already; worded without the body
            parsed = None
        await self._guarded(scope, receive, send, parsed)

    async def _guarded(
        self, scope: Scope, receive: Receive, send: Send, parsed: BaseModel | None
    ) -> int:
        """Run the application; an event stream's start waits for its first event and its end
        for the application's return (see the module docstring). Returns the status sent."""
        held: Message | None = None  # an event stream's start, not yet sent
        final: Message | None = None  # an event stream's last (empty) body, not yet sent
        state = {"status": 500, "started": False, "stream": False}

        async def guarded(message: Message) -> None:
            nonlocal held, final
            if message["type"] == "http.response.start":
                state["status"] = int(message["status"])
                if _is_event_stream(message):
                    state["stream"] = True
                    held = message
                    return
                state["started"] = True
            elif message["type"] == "http.response.body" and state["stream"]:
                if not message.get("more_body", False):
                    final = message
                    return
                if held is not None:
                    if not message.get("body"):
                        return
                    start, held = held, None
                    await send(start)
                    state["started"] = True
            await send(message)

        try:
            await self.app(scope, receive, guarded)
        except Exception as exc:
            refused = Refused.within(exc)  # a stream's failure comes in its task group's group
            if refused is not None and not state["started"]:
                raise refused from None  # the guard answers it: its words, its status
            problem = self.describe(refused or exc, parsed)
            if not state["started"]:
                payload = json.dumps({"error": error_object(problem)}).encode()
                await send_json(send, problem.status, payload, problem.headers)
                return problem.status
            if not state["stream"]:
                raise
            if problem.status >= 500 and refused is None:  # the server's business
                problem = FAILED
            line = b"data: " + json.dumps({"error": error_object(problem)}).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": line, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return int(state["status"])
        if held is not None:  # a stream that ended before any event: sent as it is
            await send(held)
        if final is not None:
            await send(final)
        return int(state["status"])


def _is_event_stream(start: Message) -> bool:
    for key, value in start.get("headers", []):
        if key.lower() == b"content-type":
            return bool(value.split(b";")[0].strip() == b"text/event-stream")
    return False
