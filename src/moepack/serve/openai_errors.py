"""Bad requests answered in the OpenAI error shape with a 4xx status, before or instead of what
llama-cpp-python's server would do with them (an ASGI middleware in front of its application).

llama-cpp-python's routes answer a context overflow of a plain request with OpenAI's shape
themselves (``RouteErrorHandler``), and every other failure of a plain request with a 500 in
that shape. What they let through, and this middleware catches:

- a body that is not JSON, or not an object: its handler fails again while wording the
  failure, and Starlette answers a bare 500; here: 400 ``invalid_request_error``;
- an unknown ``model``: its ``LlamaProxy`` quietly serves the one model instead; here: 404
  ``model_not_found``, as OpenAI answers;
- a request its own request types refuse (a negative ``max_tokens`` of a completion):
  FastAPI's 422 turned into a 500 by the same wording failure; here: 400 naming the field,
  found by those same types (``CreateCompletionRequest``, ``CreateChatCompletionRequest``),
  and a negative ``max_tokens`` of a chat completion, which its type lets through and
  llama-cpp-python reads as "until the context is full";
- ``logprobs`` from a server that keeps no logits but the last token's (``logits_all`` off,
  which llama-cpp-python answers with a 500);
- a streamed request that fails before its first event (a prompt longer than the context):
  the SSE response has already begun, so the client would read an empty stream; here the
  start of an event stream is held until its first event, and a failure before it is
  answered as a plain request's would be (``RouteErrorHandler``'s own wording, so the status
  and text are the server's); a failure after it ends the stream with an ``error`` event,
  which the OpenAI clients raise.

It also counts completion requests in flight (queued on the model ones included) and answered.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .metrics import RequestCounts

Describe = Callable[[Exception, BaseModel | None], tuple[int, dict[str, Any]]]


def error(message: str, param: str | None = None, code: str | None = None,
          kind: str = "invalid_request_error") -> dict[str, Any]:  # fmt: skip
    """The ``error`` object of OpenAI's error responses."""
    return {"message": message, "type": kind, "param": param, "code": code}


class OpenAIErrors:
    """The middleware (see the module docstring). ``requests``: path -> the request type that
    checks its body; ``models``: the names the server answers to; ``describe``: an
    exception -> (status, error) as the application words it; ``logprobs``: whether the model
    keeps every token's logits."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        requests: dict[str, type[BaseModel]],
        models: Collection[str],
        describe: Describe,
        counts: RequestCounts,
        logprobs: bool = True,
    ) -> None:
        self.app = app
        self.requests = requests
        self.models = models
        self.describe = describe
        self.counts = counts
        self.logprobs = logprobs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body, early = await _read_body(receive)
        if early is not None:  # the client left before its body arrived
            return
        replay = _replayed(body, receive)
        kind = self.requests.get(scope["path"])
        try:
            data = json.loads(body) if body.strip() else None
        except ValueError as e:
            await _answer(send, 400, error(f"the request body is not valid JSON ({e})"))
            return
        if kind is None:  # another route: only its JSON is checked here
            if body.strip() and not isinstance(data, dict):
                await _answer(send, 400, error("the request body must be a JSON object"))
                return
            await self.app(scope, replay, send)
            return
        checked, problem, parsed = self.check(data, kind)
        self.counts.started()
        status = 500  # what a failure of the application itself leaves the client with
        try:
            if problem is not None:
                status = checked
                await _answer(send, status, problem)
            else:
                status = await self._guarded(scope, replay, send, parsed)
        finally:
            self.counts.finished(scope["path"], status)

    def check(
        self, data: Any, kind: type[BaseModel]
    ) -> tuple[int, dict[str, Any] | None, BaseModel | None]:
        """(status, error or None, the parsed request) of a completion request's body."""
        if not isinstance(data, dict):
            return 400, error("the request body must be a JSON object"), None
        model = data.get("model")
        if model is not None and model not in self.models:
            names = ", ".join(f"`{m}`" for m in self.models)
            return 404, error(f"The model `{model}` does not exist (this server serves {names})",
                              "model", "model_not_found"), None  # fmt: skip
        max_tokens = data.get("max_tokens")
        if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens < 0:
            return 400, error(f"`max_tokens` must be 0 or more, got {max_tokens}", "max_tokens",
                              "integer_below_min_value"), None  # fmt: skip
        chat = "messages" in kind.model_fields
        wants = data.get("logprobs") if chat else data.get("logprobs", None) is not None
        if wants and not self.logprobs:
            return 400, error("logprobs need the logits of every token, which this server "
                              "keeps only while it traces (--trace-out)", "logprobs"), None  # fmt: skip
        try:
            parsed = kind.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or None
            text = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
            return 400, error(text, where, str(first.get("type"))), None
        return 200, None, parsed

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
            if not state["started"]:
                status, problem = self.describe(exc, parsed)
                await _answer(send, status, problem)
                return status
            if not state["stream"]:
                raise
            status, problem = self.describe(exc, parsed)
            line = b"data: " + json.dumps({"error": problem}).encode() + b"\n\n"
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


async def _read_body(receive: Receive) -> tuple[bytes, Message | None]:
    """The whole request body; or the disconnect that came before its end."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks), message
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), None


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


async def _answer(send: Send, status: int, problem: dict[str, Any]) -> None:
    payload = json.dumps({"error": problem}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
            ],
        }  # fmt: skip
    )
    await send({"type": "http.response.body", "body": payload, "more_body": False})
