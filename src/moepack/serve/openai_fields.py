"""What OpenAI's chat completion responses carry and llama-cpp-python's leave out, and the
model list of the served names.

- Every ``message`` has ``refusal`` (required, nullable: null, the model refuses nothing by
  itself) and ``annotations`` (``[]``), every choice ``logprobs`` (null unless asked): OpenAI's
  schema requires them, and clients that validate against it (and llm-comply) refused the
  answers without them. llama-cpp-python's route declares its response as a ``TypedDict``,
  which drops keys it does not know, so they are added to the bytes on their way out (an ASGI
  middleware on ``/v1/chat/completions``).
- ``stream_options: {"include_usage": true}``: every chunk carries ``usage: null`` and the last
  one before ``[DONE]`` has no choices and the request's ``usage`` (the meter's counts: the
  prompt's tokens, and the tokens sampled less the end-of-turn token, as the plain answer's
  ``completion_tokens``), as OpenAI streams it.
- ``GET /v1/models`` lists the plain names the model answers to (``names``), in OpenAI's shape,
  or in Anthropic's (``type: model``, ``display_name``, ``has_more``…) for a request carrying
  ``anthropic-version``, as Anthropic's SDK sends it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .guard import PARSED
from .names import ModelNames
from .requestlog import current

CHAT = "/v1/chat/completions"
DONE = b"data: [DONE]"


def usage_now(is_eog: Callable[[int], bool]) -> dict[str, int] | None:
    """The current request's usage as OpenAI's answers count it (None: no generation)."""
    rec = current()
    if rec is None or not rec.generations:
        return None
    tokens = [t for g in rec.generations for t in g.generated]
    sampled = len(tokens) - (1 if tokens and is_eog(tokens[-1]) else 0)
    prompt = len(rec.generations[0].prompt)
    return {"prompt_tokens": prompt, "completion_tokens": sampled, "total_tokens": prompt + sampled}


class OpenAIFields:
    """The middleware (see the module docstring); ``is_eog``: whether a token ends a turn."""

    def __init__(self, app: ASGIApp, *, is_eog: Callable[[int], bool]) -> None:
        self.app = app
        self.is_eog = is_eog

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != CHAT or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body = scope.get(PARSED)
        options = body.get("stream_options") if isinstance(body, dict) else None
        usage = isinstance(options, dict) and options.get("include_usage") is True
        held: Message | None = None  # a plain answer's start, sent with its mended body
        parts: list[bytes] = []
        stream = False

        async def mended(message: Message) -> None:
            nonlocal held, stream
            if message["type"] == "http.response.start":
                kind = dict(message.get("headers", [])).get(b"content-type", b"")
                stream = kind.startswith(b"text/event-stream")
                if int(message["status"]) == 200 and kind.startswith(b"application/json"):
                    held = message
                    return
            elif message["type"] == "http.response.body" and held is not None:
                parts.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                payload = _plain(b"".join(parts))
                headers = [(k, v) for k, v in held.get("headers", []) if k != b"content-length"]
                headers.append((b"content-length", str(len(payload)).encode()))
                await send({**held, "headers": headers})
                message = {"type": "http.response.body", "body": payload, "more_body": False}
            elif message["type"] == "http.response.body" and stream:
                message = {**message, "body": self._events(message.get("body", b""), usage)}
            await send(message)

        await self.app(scope, receive, mended)

    def _events(self, data: bytes, usage: bool) -> bytes:
        """The chunks of one body message of the stream, mended; the usage chunk before
        ``[DONE]``."""
        out: list[bytes] = []
        last: dict[str, Any] | None = None
        for line in data.split(b"\n"):
            if line.startswith(b"data: {"):
                try:
                    chunk = json.loads(line[6:])
                except ValueError:
                    out.append(line)
                    continue
                for choice in chunk.get("choices") or []:
                    if isinstance(choice, dict):
                        choice.setdefault("logprobs", None)
                        choice.setdefault("finish_reason", None)
                if usage:
                    chunk["usage"] = None
                last = chunk
                out.append(b"data: " + json.dumps(chunk).encode())
            elif line.startswith(DONE) and usage:
                counts = usage_now(self.is_eog)
                final = {
                    "id": (last or {}).get("id", "chatcmpl-usage"),
                    "object": "chat.completion.chunk",
                    "created": (last or {}).get("created", int(time.time())),
                    "model": (last or {}).get("model", ""),
                    "choices": [],
                    "usage": counts,
                }
                out += [b"data: " + json.dumps(final).encode(), b"", line]
            else:
                out.append(line)
        return b"\n".join(out)


def _plain(body: bytes) -> bytes:
    try:
        data = json.loads(body)
    except ValueError:
        return body
    for choice in data.get("choices") or [] if isinstance(data, dict) else []:
        if not isinstance(choice, dict):
            continue
        choice.setdefault("logprobs", None)
        message = choice.get("message")
        if isinstance(message, dict):
            message.setdefault("refusal", None)
            message.setdefault("annotations", [])
    return json.dumps(data).encode()


def models_list(names: ModelNames) -> Callable[[Request], Any]:
    """``GET /v1/models``: OpenAI's list, or Anthropic's for Anthropic's clients."""
    created = int(time.time())

    async def endpoint(request: Request) -> Response:
        listed = names.listed
        if "anthropic-version" in request.headers:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
            return JSONResponse(
                {
                    "data": [
                        {"type": "model", "id": n, "display_name": n, "created_at": stamp}
                        for n in listed
                    ],
                    "has_more": False,
                    "first_id": listed[0],
                    "last_id": listed[-1],
                }
            )
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"id": n, "object": "model", "created": created, "owned_by": "moepack"}
                    for n in listed
                ],
            }
        )

    return endpoint
