"""OpenAI's Responses API on the served model: ``POST /v1/responses``, plain and streamed.

A raw ASGI route behind the guard, like Anthropic's: the guard reads the body and checks it as
the route reads it (``responses_request``: the checks every API makes), its refusals in
OpenAI's error shape. The request runs as a ``create_chat_completion`` on the one ``Llama``
under llama-cpp-python's own lock, so it queues with every other API's, and the meter,
``/metrics``, the request log and ``--trace-out`` count it alike.

The answer is a ``response`` object with every field the API's schema requires: ``output``
items (a ``message`` with one ``output_text`` part, and a ``function_call`` item per call),
``status`` ``completed`` — or ``incomplete`` with ``incomplete_details.reason``
``max_output_tokens`` when the budget ran out — ``usage`` (the prompt's tokens, of them
``cached_tokens`` the prefix llama.cpp kept from the previous request, and the tokens sampled
less the end-of-turn token) and the request's settings echoed; nothing is stored (``store``
false). Streamed, it is the API's event sequence, each event numbered (``sequence_number``):
``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``…, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, then ``response.completed`` (or
``response.incomplete``). The first event waits for the prompt's prefill (a prompt longer than
the context is a 400, not a broken stream); a failure later is an ``error`` event; a client that
leaves stops its generation. With tools the answer is computed whole and then sent as its
events (``function_call_arguments.delta`` and ``.done`` for a call).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from .anthropic_api import PromptProbe
from .checks import RequestChecks
from .guard import PARSED, Route
from .llamacalls import close_chunks, model_lock
from .names import ModelNames
from .openai_fields import usage_now
from .requestlog import RequestRecord, current
from .responses_request import ResponsesCall, ResponsesError, budget, read_call
from .shapes import ApiProblem, Refused, error_object, send_json

PATH = "/v1/responses"
DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "presence_penalty",
            "frequency_penalty")  # fmt: skip


class ResponsesApi:
    """The route's ASGI application (see the module docstring)."""

    def __init__(self, *, llm: Any, names: ModelNames, checks: RequestChecks, is_eog: Any) -> None:
        from llama_cpp.server.types import CreateChatCompletionRequest

        self.llm = llm
        self.names = names
        self.checks = checks
        self.is_eog = is_eog
        fields = CreateChatCompletionRequest.model_fields
        self.defaults = {k: fields[k].default for k in DEFAULTS if k in fields}
        self.probe = PromptProbe(llm)

    @property
    def chat_format(self) -> str:
        return str(self.llm.chat_format)

    def check(self, data: Any) -> tuple[ApiProblem | None, Any]:
        """``Route.check``: the body read as the route reads it, every part checked."""
        try:
            read_call(data, self.names, self.chat_format, self.defaults, self.checks)
        except ResponsesError as e:
            return e.problem, data
        return None, data

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            call = read_call(
                scope[PARSED], self.names, self.chat_format, self.defaults, self.checks, False
            )
            if call.stream and not call.kwargs.get("tools"):
                await self._stream(call, receive, send)
                return
            answer = await self._plain(call)
            if call.stream:
                await self._replay(call, answer, send)
                return
            await send_json(send, 200, json.dumps(answer).encode())
        except ResponsesError as e:
            await send_json(
                send, e.problem.status, json.dumps({"error": error_object(e.problem)}).encode()
            )

    # -- plain -----------------------------------------------------------------------------

    async def _plain(self, call: ResponsesCall) -> dict[str, Any]:
        created = int(time.time())
        kwargs = {**call.kwargs, "stream": False}
        async with model_lock():
            if call.auto:
                result = await _run(lambda: self.probe.auto(kwargs))
            else:
                result = await _run(lambda: self.llm.create_chat_completion(**kwargs))
        choice = result["choices"][0]
        message = choice.get("message") or {}
        output: list[dict[str, Any]] = []
        text = message.get("content") or ""
        finish = choice.get("finish_reason")
        status = "incomplete" if finish == "length" else "completed"
        if text or not message.get("tool_calls"):
            output.append(_message(text, status))
        for tc in message.get("tool_calls") or []:
            fn = tc.get("function") or {}
            output.append(_function_call(fn.get("name", ""), fn.get("arguments") or "", status))
        return self._resource(call, created, status, output, finish)

    def _resource(
        self,
        call: ResponsesCall,
        created: int,
        status: str,
        output: list[dict[str, Any]],
        finish: str | None,
        ident: str | None = None,
    ) -> dict[str, Any]:
        """The ``response`` object (``status`` ``in_progress``: no usage, no completion yet)."""
        rec = current()
        done = status != "in_progress"
        if done and rec is not None:
            rec.stop_reason = {"length": "length", "tool_calls": "tool_calls"}.get(
                str(finish), "stop"
            )
        return {
            "id": ident or _id("resp"),
            "object": "response",
            "created_at": created,
            "completed_at": int(time.time()) if done else None,
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "model": call.model,
            "previous_response_id": None,
            "output": output,
            "error": None,
            **call.echo,
            "top_logprobs": 0,
            "reasoning": {"effort": None, "summary": None},
            "usage": _usage(rec, self.is_eog) if done else None,
            "max_tool_calls": None,
            "store": False,
            "background": False,
            "service_tier": "default",
        }

    # -- streamed --------------------------------------------------------------------------

    async def _replay(self, call: ResponsesCall, answer: dict[str, Any], send: Send) -> None:
        """A finished response as the events a stream of it would have been."""
        events = _ResponseEvents(send)
        await _start(send)
        start = {**answer, "status": "in_progress", "output": [], "usage": None,
                 "completed_at": None, "incomplete_details": None}  # fmt: skip
        await events.send("response.created", response=start)
        await events.send("response.in_progress", response=start)
        for index, item in enumerate(answer["output"]):
            if item["type"] == "message":
                await events.message(index, item, [item["content"][0]["text"]])
            else:
                await events.function_call(index, item)
        await events.send(_terminal(answer["status"]), response=answer)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _stream(self, call: ResponsesCall, receive: Receive, send: Send) -> None:
        created = int(time.time())
        ident = _id("resp")
        async with model_lock():
            chunks: Iterator[Any] = await _run(
                lambda: self.llm.create_chat_completion(**{**call.kwargs, "stream": True})
            )
            try:
                first = await _run(lambda: next(chunks, None))
            except BaseException:
                await run_in_threadpool(close_chunks, chunks)
                raise
            try:
                await self._events(call, chunks, first, created, ident, receive, send)
            finally:
                await run_in_threadpool(close_chunks, chunks)

    async def _events(
        self,
        call: ResponsesCall,
        chunks: Iterator[Any],
        first: Any,
        created: int,
        ident: str,
        receive: Receive,
        send: Send,
    ) -> None:
        events = _ResponseEvents(send)
        await _start(send)
        start = self._resource(call, created, "in_progress", [], None, ident)
        await events.send("response.created", response=start)
        await events.send("response.in_progress", response=start)
        item_id = _id("msg")
        item: dict[str, Any] = {"id": item_id, "type": "message", "status": "in_progress",
                                "role": "assistant", "content": []}  # fmt: skip
        await events.send("response.output_item.added", output_index=0, item=item)
        part: dict[str, Any] = {
            "type": "output_text",
            "text": "",
            "annotations": [],
            "logprobs": [],
        }
        await events.send("response.content_part.added", item_id=item_id, output_index=0,
                          content_index=0, part=part)  # fmt: skip
        left = anyio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            left.set()

        text, finish, failed = "", None, None
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            chunk = first
            try:
                while chunk is not None and not left.is_set():
                    choice = (chunk.get("choices") or [{}])[0]
                    finish = choice.get("finish_reason") or finish
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        text += piece
                        await events.send("response.output_text.delta", item_id=item_id,
                                          output_index=0, content_index=0, delta=piece,
                                          logprobs=[])  # fmt: skip
                    chunk = await _run(lambda: next(chunks, None))
            except (ResponsesError, Refused) as e:
                failed = e.problem
            tg.cancel_scope.cancel()
        if left.is_set():
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if failed is not None:
            await events.error(failed)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await run_in_threadpool(close_chunks, chunks)  # the generation closed: its counts are whole
        status = "incomplete" if finish == "length" else "completed"
        done_part = {**part, "text": text}
        await events.send("response.output_text.done", item_id=item_id, output_index=0,
                          content_index=0, text=text, logprobs=[])  # fmt: skip
        await events.send("response.content_part.done", item_id=item_id, output_index=0,
                          content_index=0, part=done_part)  # fmt: skip
        item = {**item, "status": status, "content": [done_part]}
        await events.send("response.output_item.done", output_index=0, item=item)
        final = self._resource(call, created, status, [item], finish, ident)
        await events.send(_terminal(status), response=final)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class _ResponseEvents:
    """Server-sent events of one response, numbered."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.sequence = 0

    async def send(self, kind: str, **fields: Any) -> None:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        body = f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()
        await self._send({"type": "http.response.body", "body": body, "more_body": True})

    async def error(self, problem: ApiProblem) -> None:
        """A failure after the stream began: the error object nested (the Open Responses
        spec's event) and its fields at the top (the ``openai`` SDK's ``ResponseErrorEvent``)."""
        error = error_object(problem)
        await self.send(
            "error",
            code=error["code"],
            message=error["message"],
            param=error["param"],
            error=error,
        )

    async def message(self, index: int, item: dict[str, Any], pieces: list[str]) -> None:
        ident = item["id"]
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        await self.send("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "content": []})  # fmt: skip
        await self.send("response.content_part.added", item_id=ident, output_index=index,
                        content_index=0, part=part)  # fmt: skip
        for piece in pieces:
            if piece:
                await self.send("response.output_text.delta", item_id=ident, output_index=index,
                                content_index=0, delta=piece, logprobs=[])  # fmt: skip
        text = "".join(pieces)
        await self.send("response.output_text.done", item_id=ident, output_index=index,
                        content_index=0, text=text, logprobs=[])  # fmt: skip
        await self.send("response.content_part.done", item_id=ident, output_index=index,
                        content_index=0, part={**part, "text": text})  # fmt: skip
        await self.send("response.output_item.done", output_index=index, item=item)

    async def function_call(self, index: int, item: dict[str, Any]) -> None:
        await self.send("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "arguments": ""})  # fmt: skip
        await self.send("response.function_call_arguments.delta", item_id=item["id"],
                        output_index=index, delta=item["arguments"])  # fmt: skip
        await self.send("response.function_call_arguments.done", item_id=item["id"],
                        output_index=index, arguments=item["arguments"])  # fmt: skip
        await self.send("response.output_item.done", output_index=index, item=item)


def _terminal(status: str) -> str:
    return "response.incomplete" if status == "incomplete" else "response.completed"


def _message(text: str, status: str) -> dict[str, Any]:
    return {
        "id": _id("msg"),
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _function_call(name: str, arguments: str, status: str) -> dict[str, Any]:
    try:
        json.loads(arguments)
    except ValueError:  # cut short by the budget
        status = "incomplete"
    return {
        "id": _id("fc"),
        "type": "function_call",
        "call_id": _id("call"),
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _usage(rec: RequestRecord | None, is_eog: Any) -> dict[str, Any]:
    counts = usage_now(is_eog) or {"prompt_tokens": 0, "completion_tokens": 0}
    cached = 0
    if rec is not None and rec.generations:
        first = rec.generations[0]
        cached = max(0, len(first.prompt) - first.phases["prefill"].tokens)
    prompt, sampled = counts["prompt_tokens"], counts["completion_tokens"]
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": sampled,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + sampled,
    }


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


async def _start(send: Send) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
            ],
        }
    )


async def _run(fn: Any) -> Any:
    """``fn`` in a worker thread, its failures in OpenAI's shape (no traceback); a ``Refused``
    goes on for the guard to answer."""
    try:
        return await run_in_threadpool(fn)
    except (ResponsesError, Refused):
        raise
    except ValueError as e:  # llama-cpp-python's "Requested tokens (N) exceed context window"
        raise ResponsesError(ApiProblem(400, str(e), None, "context_length_exceeded")) from None
    except Exception:
        raise ResponsesError(
            ApiProblem(500, "the server failed on this request", kind="server_error")
        ) from None


def add_responses(
    app: Any, llm: Any, names: ModelNames, routes: dict[str, Route], checks: RequestChecks
) -> None:
    """``/v1/responses`` on ``app``, and in the guard's table ``routes`` with its check."""
    from starlette.routing import Route as StarletteRoute

    from .app import eog_check

    endpoint = ResponsesApi(llm=llm, names=names, checks=checks, is_eog=eog_check(llm))
    app.router.routes.insert(0, StarletteRoute(PATH, endpoint, methods=["POST"]))
    routes[PATH] = Route(PATH, frozenset({"POST"}), endpoint.check, counted=True, budget=budget)
