"""Anthropic's Messages API on the served model: ``POST /v1/messages`` (plain and streamed) and
``POST /v1/messages/count_tokens`` (two routes of the application, raw ASGI, behind the
guard: its 404/405/413/415 and JSON checks, worded in Anthropic's shape, registered for
``/v1/messages``).

A request is read into a ``create_chat_completion`` call (``anthropic_request``) and run on
the one ``Llama`` under llama-cpp-python's own lock (its ``get_llama_proxy``), as its chat
route runs: so requests of both APIs queue on the model alike, and the meter, ``/metrics``,
the request log and ``--trace-out`` see them like any other. The answer is built with the
``anthropic`` package's own response types (``Message``, ``TextBlock``, ``ToolUseBlock``,
``Usage`` and the ``Raw…Event`` stream events), serialised by pydantic.

A stream is sent from the request's own task: the lock is taken, the generation's first
chunk awaited (prefill: a prompt longer than the context is still a 400, not a broken
stream), then ``message_start``, a ``ping``, each block's ``content_block_start``, deltas and
``content_block_stop``, ``message_delta`` (``stop_reason``, ``usage``) and ``message_stop``;
a client that leaves ends its generation after the token in progress. ``usage`` counts the
tokens the model was given and sampled (the meter's, the end-of-turn token included);
``count_tokens`` renders the prompt with the same chat handler and tokenizer, stopped where
it would generate, so it equals a request's ``input_tokens``. ``stop_reason``:
``max_tokens`` when the budget ran out, ``stop_sequence`` when llama-cpp-python cut the text
at one of ``stop_sequences`` (the earliest of them in the text sampled), ``tool_use`` for a
call, else ``end_turn``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextvars import ContextVar
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from . import checks as shared
from .anthropic_request import AnthropicError, MessagesCall, read_call
from .checks import RequestChecks, message_texts, token_budget
from .guard import PARSED, Route
from .llamacalls import close_chunks, model_lock
from .names import ModelNames
from .requestlog import current
from .shapes import ApiProblem, Refused, Shapes, send_json

if TYPE_CHECKING:
    from anthropic.types import StopReason

MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
BODY_MAX = 32 << 20
"""Bytes a request body may have here (Anthropic's own limit; the guard's ``--max-body``
refuses a larger one first)."""
SAMPLING = ("min_p", "repeat_penalty", "presence_penalty", "frequency_penalty")
"""llama-cpp-python's sampling fields Anthropic has not: its own request type's defaults."""
EXTRAS = ("logit_bias", "seed", *SAMPLING)
"""llama-cpp-python's fields a client may add to a Messages request (``extra_body``)."""
_PROBING: ContextVar[bool] = ContextVar("moepack_probe", default=False)
_AUTO_BUDGET: ContextVar[int | None] = ContextVar("moepack_auto_budget", default=None)


def error_body(kind: str, message: str) -> dict[str, Any]:
    """Anthropic's error shape."""
    return {"type": "error", "error": {"type": kind, "message": message}}


class _Counted(Exception):
    def __init__(self, prompt: str | list[int], kwargs: dict[str, Any]) -> None:
        self.prompt = prompt
        self.kwargs = kwargs  # the rest of the completion the chat handler asked for


class PromptProbe:
    """The prompt a chat request becomes, counted by the chat handler that would run it: the
    ``Llama``'s ``create_completion`` is wrapped so that, in a context that counts, it stops
    the handler with the prompt's length instead of generating (other threads unaffected).

    The same wrapper mends ``chatml-function-calling``'s automatic tool choice (0.3.36), in a
    context that asks (``auto``): once the model chose to answer with a message, its handler
    constrains the message to the grammar of a function name or ``<|im_end|>`` and asks for
    no token limit, so the answer would be empty; here that completion runs free, to the
    request's ``max_tokens`` (which the calls' arguments are bounded by too)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        inner = llm.create_completion

        def create_completion(*args: Any, **kwargs: Any) -> Any:
            if _PROBING.get():
                raise _Counted(kwargs["prompt"] if "prompt" in kwargs else args[0], kwargs)
            budget = _AUTO_BUDGET.get()
            if budget is not None and kwargs.get("stop") != [":"]:  # not the choice itself
                if kwargs.get("max_tokens") is None:
                    kwargs["max_tokens"] = budget
                prompt = kwargs.get("prompt")
                if isinstance(prompt, str) and prompt.endswith("message:\n"):
                    kwargs["grammar"] = None
            return inner(*args, **kwargs)

        llm.create_completion = create_completion

    def _tokens(self, prompt: str | list[int]) -> int:
        if not isinstance(prompt, str):
            return len(prompt)
        if not prompt:  # llama-cpp-python's own rule for an empty prompt
            return 1
        return len(self.llm.tokenize(prompt.encode("utf-8"), special=True))

    def prompt(self, kwargs: dict[str, Any]) -> str | list[int]:
        """The prompt (text or tokens) the chat handler makes of ``kwargs``."""
        return self.completion(kwargs)[0]

    def completion(self, kwargs: dict[str, Any]) -> tuple[str | list[int], dict[str, Any]]:
        """The prompt the chat handler makes of ``kwargs``, and where it asks the completion
        to end (its chat format's ``stop`` sequences and ``stopping_criteria``)."""
        token = _PROBING.set(True)
        try:
            self.llm.create_chat_completion(**kwargs, max_tokens=1, stream=False)
        except _Counted as c:
            stop = c.kwargs.get("stop") or []
            return c.prompt, {
                "stop": [stop] if isinstance(stop, str) else list(stop),
                "stopping_criteria": c.kwargs.get("stopping_criteria"),
            }
        finally:
            _PROBING.reset(token)
        raise RuntimeError("the chat handler never asked for a completion")

    def auto(self, kwargs: dict[str, Any]) -> Any:
        """``create_chat_completion`` with the automatic tool choice mended (see above)."""
        token = _AUTO_BUDGET.set(int(kwargs.get("max_tokens") or 0) or None)
        try:
            return self.llm.create_chat_completion(**kwargs)
        finally:
            _AUTO_BUDGET.reset(token)

    def count(self, kwargs: dict[str, Any]) -> int:
        return self._tokens(self.prompt(kwargs))

    def text(self, kwargs: dict[str, Any]) -> str:
        prompt = self.prompt(kwargs)
        if isinstance(prompt, str):
            return prompt
        return bytes(self.llm.detokenize(prompt)).decode("utf-8", errors="replace")


class AnthropicShape:
    """``{"type": "error", "error": {"type", "message"}}`` with Anthropic's error types, for
    the guard's ``Shapes``."""

    KINDS = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        529: "overloaded_error",
    }

    def body(self, problem: ApiProblem) -> dict[str, Any]:
        return error_body(kind_of(problem.status), problem.message)


def kind_of(status: int) -> str:
    """Anthropic's error type for a status."""
    kind = AnthropicShape.KINDS.get(status)
    if kind is None:
        kind = "api_error" if status >= 500 else "invalid_request_error"
    return kind


def shapes_with_anthropic() -> Shapes:
    """The guard's shapes: OpenAI's, and Anthropic's under ``/v1/messages``."""
    shapes = Shapes()
    shapes.register(MESSAGES, AnthropicShape())
    return shapes


class AnthropicMessages:
    """The two routes' ASGI application (see the module docstring)."""

    def __init__(self, *, llm: Any, models: ModelNames, checks: RequestChecks) -> None:
        from llama_cpp.server.types import CreateChatCompletionRequest

        self.llm = llm
        self.models = models
        self.checks = checks
        fields = CreateChatCompletionRequest.model_fields
        self.defaults = {k: fields[k].default for k in ("top_p", "top_k", *SAMPLING)}
        self.probe = PromptProbe(llm)

    @property
    def chat_format(self) -> str:
        return str(self.llm.chat_format)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._answer(scope, receive, send, str(scope["path"]))

    async def _answer(self, scope: Scope, receive: Receive, send: Send, path: str) -> int:
        try:
            if PARSED in scope:  # the guard read and checked it
                data = scope[PARSED]
            else:
                body = await _body(receive)
                if body is None:
                    return 499  # the client left
                try:
                    data = json.loads(body) if body.strip() else None
                except ValueError as e:
                    raise AnthropicError(400, f"the request body is not valid JSON ({e})") from None
            call = read_call(
                data, self.models, self.chat_format, self.defaults, count_only=path == COUNT
            )
            _extras(data, call)
            data = data if isinstance(data, dict) else {}
            if path == COUNT:
                async with model_lock():
                    n = await _run(lambda: self._count(call, data))
                await _json(send, 200, {"input_tokens": n})
                return 200
            auto = call.kwargs.get("tool_choice") == "auto"
            if call.stream and not auto:
                return await self._stream(call, data, receive, send)
            message = await self._plain(call, data, auto)
            if call.stream:  # llama-cpp-python streams no automatic tool choice: sent whole
                await self._replay(message, send)
                return 200
            await _json(
                send, 200, full_message(message.model_dump(mode="json", exclude_unset=True))
            )
            return 200
        except AnthropicError as e:
            await _json(send, e.status, error_body(e.kind, e.message))
            return e.status
        except _StreamStarted:
            return 200

    def check(self, data: Any, count_only: bool = False) -> tuple[ApiProblem | None, Any]:
        """The guard's check of a body (``Route.check``): the request read as the route reads
        it, then what it asks of llama.cpp by the checks every API makes (``checks``): the
        prompt's size, the sampling numbers and ``logit_bias``, the grammar of every tool a
        call may be made of."""
        try:
            call = read_call(data, self.models, self.chat_format, self.defaults, count_only)
            if not count_only:
                numbers = {k: v for k, v in data.items() if k in shared.SAMPLING}
                problem = self.checks.numbers(numbers)
                problem = problem or self.checks.logit_bias(data.get("logit_bias"))
                if problem is not None:
                    return problem, data
                _extras(data, call)
        except AnthropicError as e:
            return ApiProblem(e.status, e.message), data
        texts = [*message_texts(call.kwargs["messages"]), *call.tool_texts]
        problem = self.checks.prompt_bytes(texts, "messages")
        tools = call.kwargs.get("tools") or []
        return problem or self.checks.schemas(
            (f"tools.{t['function']['name']}.input_schema", t["function"]["parameters"])
            for t in tools
        ), data

    def _count(self, call: MessagesCall, data: dict[str, Any]) -> int:
        """``count_tokens``: the prompt as a request would have it, tokenised."""
        if call.tool_texts:
            self._show_tools(call, data)
        keys = ("messages", "tools", "tool_choice")
        return self.probe.count({k: v for k, v in call.kwargs.items() if k in keys})

    def _show_tools(self, call: MessagesCall, data: dict[str, Any]) -> None:
        """Tool calls and results the chat format leaves out of the prompt (llama-cpp-python's
        named formats render only user, assistant and system text) go in as plain turns."""
        keys = ("messages", "tools", "tool_choice")
        rendered = self.probe.text({k: v for k, v in call.kwargs.items() if k in keys})
        if all(t in rendered for t in call.tool_texts):
            return
        from .anthropic_request import chat_messages

        call.kwargs["messages"] = chat_messages(data, as_text=True)

    # -- plain -----------------------------------------------------------------------------

    async def _plain(self, call: MessagesCall, data: dict[str, Any], auto: bool = False) -> Any:
        async with model_lock():
            if call.tool_texts:
                await _run(lambda: self._show_tools(call, data))
            kwargs = {**call.kwargs, "stream": False}
            if auto:
                result = await _run(lambda: self.probe.auto(kwargs))
            else:
                result = await _run(lambda: self.llm.create_chat_completion(**kwargs))
        from anthropic.types import Message, TextBlock, ToolUseBlock, Usage

        choice = result["choices"][0]
        text = choice["message"].get("content") or ""
        content: list[Any] = [TextBlock(type="text", text=text)] if text else []
        whole = True
        for tc in choice["message"].get("tool_calls") or []:
            args = tc["function"]["arguments"]
            value, complete = _arguments(args)
            whole = whole and complete
            if isinstance(value, dict):
                content.append(
                    ToolUseBlock(
                        type="tool_use", id=_id("toolu"), name=tc["function"]["name"], input=value
                    )
                )
            else:  # not an object, even as the start of one: shown as text
                content.append(TextBlock(type="text", text=args))
        reason, sequence = self._stop(call, choice.get("finish_reason"), text)
        if reason == "tool_use" and (not whole or not any(b.type == "tool_use" for b in content)):
            reason = "max_tokens"  # a call cut short is one llama-cpp-python calls finished
        usage = _usage(result.get("usage", {}))
        rec = current()
        if rec is not None:
            rec.stop_reason = reason
        message = Message(
            id=_id("msg"),
            type="message",
            role="assistant",
            model=call.model,
            content=content,
            stop_reason=reason,
            stop_sequence=sequence,
            usage=Usage(input_tokens=usage[0], output_tokens=usage[1]),
        )
        return message

    async def _replay(self, message: Any, send: Send) -> None:
        """A finished ``Message`` as the events a stream of it would have been."""
        from anthropic.types import (
            InputJSONDelta,
            MessageDeltaUsage,
            RawContentBlockDeltaEvent,
            RawContentBlockStartEvent,
            RawContentBlockStopEvent,
            RawMessageDeltaEvent,
            RawMessageStartEvent,
            RawMessageStopEvent,
            TextBlock,
            TextDelta,
            ToolUseBlock,
        )
        from anthropic.types.raw_message_delta_event import Delta

        await _start_stream(send)
        start = message.model_copy(
            update={"content": [], "stop_reason": None, "stop_sequence": None}
        )
        start.usage = message.usage.model_copy(update={"output_tokens": 0})
        events: list[Any] = [RawMessageStartEvent(type="message_start", message=start)]
        for i, b in enumerate(message.content):
            if b.type == "text":
                opened: Any = TextBlock(type="text", text="")
                delta: Any = TextDelta(type="text_delta", text=b.text)
            else:
                opened = ToolUseBlock(type="tool_use", id=b.id, name=b.name, input={})
                delta = InputJSONDelta(type="input_json_delta", partial_json=json.dumps(b.input))
            events += [
                RawContentBlockStartEvent(
                    type="content_block_start", index=i, content_block=opened
                ),
                RawContentBlockDeltaEvent(type="content_block_delta", index=i, delta=delta),
                RawContentBlockStopEvent(type="content_block_stop", index=i),
            ]
        events += [
            RawMessageDeltaEvent(
                type="message_delta",
                delta=Delta(stop_reason=message.stop_reason, stop_sequence=message.stop_sequence),
                usage=MessageDeltaUsage(output_tokens=message.usage.output_tokens),
            ),
            RawMessageStopEvent(type="message_stop"),
        ]
        for n, ev in enumerate(events):
            await send({"type": "http.response.body", "body": _sse(ev), "more_body": True})
            if n == 0:
                await send({"type": "http.response.body", "body": PING, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _stop(
        self, call: MessagesCall, finish: str | None, text: str
    ) -> tuple[StopReason, str | None]:
        if finish == "tool_calls":
            return "tool_use", None
        if finish == "length":
            return "max_tokens", None
        if call.stops:
            rec = current()
            if rec is not None and rec.generations:
                tokens = rec.generations[-1].generated
                full = bytes(self.llm.detokenize(tokens)).decode("utf-8", errors="replace")
                found = [(full.find(s), s) for s in call.stops if s in full]
                if found:
                    return "stop_sequence", min(found)[1]
        return "end_turn", None

    # -- streamed --------------------------------------------------------------------------

    async def _stream(
        self, call: MessagesCall, data: dict[str, Any], receive: Receive, send: Send
    ) -> int:
        async with model_lock():
            if call.tool_texts:
                await _run(lambda: self._show_tools(call, data))
            chunks: Iterator[Any] = await _run(
                lambda: self.llm.create_chat_completion(**call.kwargs)
            )
            try:
                first = await _run(lambda: next(chunks, None))
            except BaseException:
                await run_in_threadpool(close_chunks, chunks)
                raise
            try:
                await self._events(call, chunks, first, receive, send)
            finally:
                await run_in_threadpool(close_chunks, chunks)
        raise _StreamStarted

    async def _events(
        self, call: MessagesCall, chunks: Iterator[Any], first: Any, receive: Receive, send: Send
    ) -> None:
        from anthropic.types import (
            InputJSONDelta,
            MessageDeltaUsage,
            RawContentBlockDeltaEvent,
            RawContentBlockStartEvent,
            RawContentBlockStopEvent,
            RawMessageDeltaEvent,
            RawMessageStartEvent,
            RawMessageStopEvent,
            TextBlock,
            TextDelta,
            ToolUseBlock,
        )
        from anthropic.types.raw_message_delta_event import Delta

        await _start_stream(send)

        async def event(model: Any) -> None:
            await send({"type": "http.response.body", "body": _sse(model), "more_body": True})

        from anthropic.types import Message, Usage

        prompt, _ = self._usage_now()
        start = Message(
            id=_id("msg"),
            type="message",
            role="assistant",
            model=call.model,
            content=[],
            stop_reason=None,
            stop_sequence=None,
            usage=Usage(input_tokens=prompt, output_tokens=0),
        )
        await event(RawMessageStartEvent(type="message_start", message=start))
        await send({"type": "http.response.body", "body": PING, "more_body": True})
        left = anyio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            left.set()

        index = -1
        open_kind: str | None = None
        text = ""
        finish: str | None = None
        calls = 0
        arguments: list[str] = []  # each call's, as streamed
        tool_key: tuple[Any, Any] | None = None  # the open call's (index, id)
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            chunk = first
            try:
                while chunk is not None and not left.is_set():
                    choice = (chunk.get("choices") or [{}])[0]
                    delta = choice.get("delta") or {}
                    finish = choice.get("finish_reason") or finish
                    piece = delta.get("content")
                    if piece:
                        if open_kind != "text":
                            if open_kind is not None:
                                await event(
                                    RawContentBlockStopEvent(type="content_block_stop", index=index)
                                )
                            index += 1
                            open_kind = "text"
                            await event(
                                RawContentBlockStartEvent(
                                    type="content_block_start",
                                    index=index,
                                    content_block=TextBlock(type="text", text=""),
                                )
                            )
                        text += piece
                        await event(
                            RawContentBlockDeltaEvent(
                                type="content_block_delta",
                                index=index,
                                delta=TextDelta(type="text_delta", text=piece),
                            )
                        )
                    for tc in delta.get("tool_calls") or []:
                        fn = tc.get("function") or {}
                        # llama-cpp-python repeats the call's id and name in every chunk
                        key = (tc.get("index"), tc.get("id"))
                        if fn.get("name") and (open_kind != "tool_use" or key != tool_key):
                            tool_key = key
                            if open_kind is not None:
                                await event(
                                    RawContentBlockStopEvent(type="content_block_stop", index=index)
                                )
                            index += 1
                            calls += 1
                            arguments.append("")
                            open_kind = "tool_use"
                            await event(
                                RawContentBlockStartEvent(
                                    type="content_block_start",
                                    index=index,
                                    content_block=ToolUseBlock(
                                        type="tool_use", id=_id("toolu"), name=fn["name"], input={}
                                    ),
                                )
                            )
                        if fn.get("arguments") and open_kind == "tool_use":
                            arguments[-1] += fn["arguments"]
                            await event(
                                RawContentBlockDeltaEvent(
                                    type="content_block_delta",
                                    index=index,
                                    delta=InputJSONDelta(
                                        type="input_json_delta", partial_json=fn["arguments"]
                                    ),
                                )
                            )
                    chunk = await _run(lambda: next(chunks, None))
            except (AnthropicError, Refused) as e:  # failed after the stream began: an event
                if isinstance(e, Refused):
                    e = AnthropicError(
                        e.problem.status, e.problem.message, kind_of(e.problem.status)
                    )
                data = json.dumps(error_body(e.kind, e.message))
                await send(
                    {
                        "type": "http.response.body",
                        "body": f"event: error\ndata: {data}\n\n".encode(),
                        "more_body": True,
                    }
                )
                finish = "error"
            tg.cancel_scope.cancel()
        if left.is_set() or finish == "error":
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await run_in_threadpool(close_chunks, chunks)  # the generation closed: its counts are whole
        if open_kind is not None:
            await event(RawContentBlockStopEvent(type="content_block_stop", index=index))
        reason, sequence = self._stop(call, finish, text)
        if reason == "tool_use" and (not calls or not all(_arguments(a)[1] for a in arguments)):
            reason = "max_tokens"  # as ``_plain`` says it
        _, generated = self._usage_now()
        await event(
            RawMessageDeltaEvent(
                type="message_delta",
                delta=Delta(stop_reason=reason, stop_sequence=sequence),
                usage=MessageDeltaUsage(output_tokens=generated),
            )
        )
        rec = current()
        if rec is not None:
            rec.stop_reason = reason
        await event(RawMessageStopEvent(type="message_stop"))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _usage_now(self) -> tuple[int, int]:
        """(prompt tokens, tokens sampled) of the current request's generations so far."""
        rec = current()
        if rec is None or not rec.generations:
            return 0, 0
        return len(rec.generations[0].prompt), sum(len(g.generated) for g in rec.generations)


PING = b'event: ping\ndata: {"type": "ping"}\n\n'


def full_message(message: dict[str, Any]) -> dict[str, Any]:
    """A ``Message`` with every field today's Messages API answers with (its schema requires
    them, nullable or not; the ``anthropic`` package's types leave the unset ones out):
    ``stop_details`` and ``container`` null, ``usage`` with its cache counts (0: the server
    keeps no prompt cache a client can address) and the fields it has no value for null,
    text blocks' ``citations`` null, a tool call's ``caller`` the model itself."""
    message.setdefault("stop_details", None)
    message.setdefault("container", None)
    usage = message.get("usage")
    if isinstance(usage, dict):
        usage.setdefault("cache_creation_input_tokens", 0)
        usage.setdefault("cache_read_input_tokens", 0)
        usage.setdefault(
            "cache_creation", {"ephemeral_1h_input_tokens": 0, "ephemeral_5m_input_tokens": 0}
        )
        for name in ("inference_geo", "output_tokens_details", "server_tool_use", "service_tier"):
            usage.setdefault(name, None)
    for block in message.get("content") or []:
        full_block(block)
    return message


def full_block(block: Any) -> Any:
    """A content block with the fields the schema requires (see ``full_message``)."""
    if isinstance(block, dict) and block.get("type") == "text":
        block.setdefault("citations", None)
    elif isinstance(block, dict) and block.get("type") == "tool_use":
        block.setdefault("caller", {"type": "direct"})
    return block


def _sse(model: Any) -> bytes:
    """One server-sent event of an ``anthropic`` stream event model."""
    data = model.model_dump(mode="json", exclude_unset=True)
    if data.get("type") == "message_start" and isinstance(data.get("message"), dict):
        full_message(data["message"])
    elif data.get("type") == "content_block_start":
        full_block(data.get("content_block"))
    return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n".encode()


async def _start_stream(send: Send) -> None:
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


class _StreamStarted(Exception):
    """The stream was answered (its status already sent)."""


def _extras(data: Any, call: MessagesCall) -> None:
    """llama-cpp-python's own fields a client added (``extra_body``), as on its chat route."""
    if not isinstance(data, dict) or "messages" not in data:
        return
    for name in EXTRAS:
        if name not in data:
            continue
        value = data[name]
        if name == "logit_bias":
            if not isinstance(value, dict):
                raise AnthropicError(400, "logit_bias: Input should be an object")
            try:
                value = {int(k): float(v) for k, v in value.items()}
            except (TypeError, ValueError):
                raise AnthropicError(400, "logit_bias: token ids to numbers") from None
        elif not isinstance(value, int | float) or isinstance(value, bool):
            raise AnthropicError(400, f"{name}: Input should be a valid number")
        call.kwargs[name] = shared.sampling_value(name, value)


def _usage(fallback: dict[str, Any]) -> tuple[int, int]:
    rec = current()
    if rec is not None and rec.generations:
        return len(rec.generations[0].prompt), sum(len(g.generated) for g in rec.generations)
    return int(fallback.get("prompt_tokens", 0)), int(fallback.get("completion_tokens", 0))


def _arguments(text: str) -> tuple[Any, bool]:
    """A call's arguments read as the Anthropic SDK reads a streamed call's (what JSON they
    hold, a call cut short read as far as it goes), and whether they are whole JSON."""
    try:
        return json.loads(text), True
    except ValueError:
        pass
    from jiter import from_json

    try:
        return from_json(text.encode("utf-8"), partial_mode=True), False
    except ValueError:
        return None, False


async def _run(fn: Any) -> Any:
    """``fn`` in a worker thread, its failures as Anthropic errors (no traceback); a ``Refused``
    goes on as it is, for the guard to answer with its problem."""
    try:
        return await run_in_threadpool(fn)
    except AnthropicError:
        raise
    except Refused:  # the server stopping, a grammar with no token left: the guard answers it
        raise
    except ValueError as e:  # llama-cpp-python's "Requested tokens (N) exceed context window"
        raise AnthropicError(400, str(e)) from None
    except Exception as e:
        raise AnthropicError(
            500, f"the model failed: {type(e).__name__}: {e}", "api_error"
        ) from None


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


async def _body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > BODY_MAX:
            raise AnthropicError(
                413, f"the request body is over {BODY_MAX:,} bytes", "request_too_large"
            )
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _json(send: Send, status: int, payload: dict[str, Any]) -> None:
    await send_json(send, status, json.dumps(payload).encode())


def add_anthropic(
    app: Any, llm: Any, names: ModelNames, routes: dict[str, Route], checks: RequestChecks
) -> None:
    """The Messages API's routes on ``app``, and in the guard's table ``routes`` with their
    checks (``AnthropicMessages.check``), both queueing for the model."""
    import anthropic.types  # noqa: F401  (its pydantic models are built now, not at a request)
    from starlette.routing import Route as StarletteRoute

    endpoint = AnthropicMessages(llm=llm, models=names, checks=checks)
    for path in (COUNT, MESSAGES):
        app.router.routes.insert(0, StarletteRoute(path, endpoint, methods=["POST"]))
    post = frozenset({"POST"})
    routes[MESSAGES] = Route(MESSAGES, post, endpoint.check, counted=True, budget=token_budget)
    routes[COUNT] = Route(COUNT, post, partial(endpoint.check, count_only=True), counted=True)
