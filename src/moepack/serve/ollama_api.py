"""Ollama's API on the served model, beside ``/v1``: ``/api/chat`` and ``/api/generate``
(NDJSON streamed, or one object), ``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/version``,
and ``/api/embed`` / ``/api/embeddings`` (``ollama_embed``; the vectors ``embedding``'s, in a
llama.cpp context of their own, under the same lock).

The routes are raw ASGI behind the guard, like Anthropic's: the guard reads the body and checks
it as the route reads it (``ollama_request``: the checks every API makes), its refusals and
the server's failures worded ``{"error": "…"}`` (``OllamaShape``, registered under ``/api/``),
with the status Ollama gives (400, 404, 405, 413, 429, 500, 503). A request runs on the one
``Llama`` under llama-cpp-python's own lock, so it queues with the other APIs' requests, and
the meter, ``/metrics``, the request log (``api`` ``ollama``) and ``--trace-out`` see it like
any other; ``--api-key`` takes Ollama clients' ``Authorization: Bearer``.

A streamed answer is one JSON object a line (``application/x-ndjson``): the text as it comes
(``message.content`` of ``/api/chat``, ``response`` of ``/api/generate``), then one object with
``done: true``, ``done_reason`` (``stop``, ``length``; ``load`` for a request with nothing to
generate, which Ollama's clients send to load a model) and the timings in nanoseconds:
``total_duration`` (from the request's arrival), ``load_duration`` (the time it waited for
the model, which is loaded once, at start), ``prompt_eval_count`` and ``_duration`` (the
prompt's tokens, the time of the passes that computed them), ``eval_count`` and
``eval_duration`` (the tokens sampled, the end-of-turn token included, and their passes:
the meter's own figures). ``/api/generate`` adds ``context``: the prompt's tokens and those
sampled, for the next request to continue. The stream's text is the plain answer's text
(``textstream``); the first line waits for the prompt's prefill, so a prompt longer than the
context is a 400, not a broken stream; a failure after it is an ``{"error"}`` line, which
Ollama's clients raise; a client that leaves stops its generation. With ``tools`` the answer
is computed whole (llama-cpp-python streams no automatic tool choice) and then sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import partial
from time import perf_counter_ns
from typing import Any

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from .anthropic_api import PromptProbe
from .checks import RequestChecks
from .embedding import Embedder
from .guard import PARSED, Route
from .llamacalls import close_chunks, model_lock
from .names import ModelNames
from .ollama_embed import EMBED, LEGACY, answer, read_embed, token_lists
from .ollama_models import OLLAMA_VERSION, OllamaModelFacts, listing, timestamp
from .ollama_request import SAMPLING_DEFAULTS, OllamaCall, OllamaError, budget, model_of, read_call
from .requestlog import RequestRecord, current
from .shapes import ApiProblem, Refused, Shapes, send_json

PREFIX = "/api/"
CHAT = "/api/chat"
GENERATE = "/api/generate"
NDJSON = b"application/x-ndjson"
FAILED = "the server failed on this request"


class OllamaShape:
    """``{"error": message}``, Ollama's error shape (the guard's ``Shapes``)."""

    def body(self, problem: ApiProblem) -> dict[str, Any]:
        return {"error": problem.message}


def register_shape(shapes: Shapes) -> Shapes:
    """``shapes`` with Ollama's under ``/api/``."""
    shapes.register(PREFIX, OllamaShape())
    return shapes


class OllamaApi:
    """The routes' ASGI application (see the module docstring)."""

    def __init__(
        self,
        *,
        llm: Any,
        names: ModelNames,
        checks: RequestChecks,
        facts: OllamaModelFacts,
        embedder: Embedder,
    ) -> None:
        from llama_cpp.server.types import CreateChatCompletionRequest

        self.llm = llm
        self.names = names
        self.checks = checks
        self.facts = facts
        self.embedder = embedder
        fields = CreateChatCompletionRequest.model_fields
        self.defaults: dict[str, Any] = {
            k: fields[k].default for k in SAMPLING_DEFAULTS if k in fields
        }
        self.defaults["max_tokens"] = None
        self.probe = PromptProbe(llm)

    @property
    def chat_format(self) -> str:
        return str(self.llm.chat_format)

    # -- the guard's checks ----------------------------------------------------------------

    def check(self, data: Any, chat: bool) -> tuple[ApiProblem | None, Any]:
        """``Route.check`` of ``/api/chat`` (``chat``) and ``/api/generate``."""
        try:
            read_call(data, self.names, chat, self.chat_format, self.defaults, self.checks)
        except OllamaError as e:
            return e.problem, data
        return None, data

    def check_model(self, data: Any) -> tuple[ApiProblem | None, Any]:
        """``/api/show``: a model the server serves."""
        try:
            model_of(data, self.names)
        except OllamaError as e:
            return e.problem, data
        return None, data

    def check_embed(self, data: Any, legacy: bool) -> tuple[ApiProblem | None, Any]:
        """``/api/embed`` (``/api/embeddings``: ``legacy``)."""
        try:
            read_embed(data, self.names, legacy, self.checks)
        except OllamaError as e:
            return e.problem, data
        return None, data

    # -- routes ------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope["path"])
        try:
            if path == "/api/version":
                await send_json(
                    send,
                    200,
                    json.dumps({"version": OLLAMA_VERSION}).encode(),
                    content_type=b"application/json; charset=utf-8",
                )
            elif path == "/api/tags":
                await send_json(
                    send,
                    200,
                    json.dumps(listing(self.names, self.facts)).encode(),
                    content_type=b"application/json; charset=utf-8",
                )
            elif path == "/api/ps":
                await send_json(
                    send,
                    200,
                    json.dumps(listing(self.names, self.facts, running=True)).encode(),
                    content_type=b"application/json; charset=utf-8",
                )
            elif path == "/api/show":
                await send_json(
                    send,
                    200,
                    json.dumps(self.facts.show()).encode(),
                    content_type=b"application/json; charset=utf-8",
                )
            elif path in (EMBED, LEGACY):
                await self._embed(scope, send, legacy=path == LEGACY)
            else:
                await self._generate(scope, receive, send, chat=path == CHAT)
        except OllamaError as e:
            await send_json(
                send,
                e.status,
                json.dumps({"error": e.message}).encode(),
                content_type=b"application/json; charset=utf-8",
            )

    async def _generate(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        call = read_call(
            scope[PARSED], self.names, chat, self.chat_format, self.defaults, self.checks, False
        )
        rec = current()
        if call.load_only:  # Ollama's clients load a model so: nothing to generate
            if rec is not None:
                rec.stop_reason = "load"
            await send_json(
                send,
                200,
                json.dumps(self._final(call, "load", None, rec)).encode(),
                content_type=b"application/json; charset=utf-8",
            )
            return
        if call.stream and not call.tools:
            await self._stream(call, receive, send)
            return
        text, calls, reason, context = await self._plain(call)
        out = self._final(call, reason, context, rec)
        out.update(self._piece(call, text, calls))
        if rec is not None:
            rec.stop_reason = reason
        if not call.stream:
            await send_json(
                send, 200, json.dumps(out).encode(), content_type=b"application/json; charset=utf-8"
            )
            return
        # streamed with tools: the answer whole, then its last line
        first = {**self._line(call, text), **self._piece(call, text, calls)}
        last = self._final(call, reason, context, rec)
        await _start(send)
        for line in (first, last):
            await send({"type": "http.response.body", "body": _line(line), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _embed(self, scope: Scope, send: Send, legacy: bool) -> None:
        call = read_embed(scope[PARSED], self.names, legacy, self.checks)
        rec = current()
        arrived = rec.start_ns if rec is not None else perf_counter_ns()
        embedder = self.embedder
        async with model_lock():
            waited = perf_counter_ns() - arrived

            def run() -> Any:
                embedder.admit()
                return embedder.embed(token_lists(call, embedder.tokens, embedder.limit))

            embedded = await _run(run)
        await send_json(
            send,
            200,
            json.dumps(answer(call, embedded, perf_counter_ns() - arrived, waited)).encode(),
            content_type=b"application/json; charset=utf-8",
        )

    # -- running -----------------------------------------------------------------------------

    def _kwargs(self, call: OllamaCall) -> dict[str, Any]:
        kwargs = dict(call.kwargs)
        if call.grammar is not None:
            from llama_cpp import LlamaGrammar

            kwargs["grammar"] = LlamaGrammar.from_string(call.grammar, verbose=False)
        return kwargs

    def _completion(self, call: OllamaCall, stream: bool) -> Any:
        """The chat completion, or the text completion ``/api/generate`` asks for (in the
        thread that runs the model)."""
        kwargs = {**self._kwargs(call), "stream": stream}
        if call.chat:
            kwargs["messages"] = call.messages
            if call.tools:
                return self.probe.auto({**kwargs, "stream": False})
            return self.llm.create_chat_completion(**kwargs)
        stops = list(kwargs.pop("stop", None) or [])
        if call.raw:
            prompt: str | list[int] = call.prompt
            if call.context:
                prompt = call.context + self._tokens(call.prompt)
        else:
            rendered, ending = self.probe.completion({"messages": call.messages})
            stops += [s for s in ending["stop"] if s not in stops]
            kwargs["stopping_criteria"] = ending["stopping_criteria"]
            prompt = rendered
            if call.context:
                tokens = self._tokens(rendered) if isinstance(rendered, str) else rendered
                if tokens and tokens[0] == self.llm.token_bos():
                    tokens = tokens[1:]  # the conversation so far began with it
                prompt = call.context + list(tokens)
        return self.llm.create_completion(prompt=prompt, stop=stops, **kwargs)

    def _tokens(self, text: str) -> list[int]:
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True))

    async def _plain(self, call: OllamaCall) -> tuple[str, list[Any], str, list[int] | None]:
        async with model_lock():
            result = await _run(lambda: self._completion(call, False))
        choice = result["choices"][0]
        if call.chat:
            message = choice.get("message") or {}
            text = message.get("content") or ""
            calls = [_tool_call(tc) for tc in message.get("tool_calls") or []]
        else:
            text, calls = choice.get("text") or "", []
        reason = "length" if choice.get("finish_reason") == "length" else "stop"
        return text, calls, reason, None if call.chat else _context(current())

    async def _stream(self, call: OllamaCall, receive: Receive, send: Send) -> None:
        async with model_lock():
            chunks: Iterator[Any] = await _run(lambda: self._completion(call, True))
            try:
                first = await _run(lambda: next(chunks, None))
            except BaseException:
                await run_in_threadpool(close_chunks, chunks)
                raise
            try:
                await self._lines(call, chunks, first, receive, send)
            finally:
                await run_in_threadpool(close_chunks, chunks)

    async def _lines(
        self, call: OllamaCall, chunks: Iterator[Any], first: Any, receive: Receive, send: Send
    ) -> None:
        await _start(send)
        left = anyio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            left.set()

        finish: str | None = None
        failed: str | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            chunk = first
            try:
                while chunk is not None and not left.is_set():
                    choice = (chunk.get("choices") or [{}])[0]
                    finish = choice.get("finish_reason") or finish
                    piece = (
                        (choice.get("delta") or {}).get("content")
                        if call.chat
                        else choice.get("text")
                    )
                    if piece:
                        line = {**self._line(call, piece), **self._piece(call, piece, [])}
                        await send(
                            {"type": "http.response.body", "body": _line(line), "more_body": True}
                        )
                    chunk = await _run(lambda: next(chunks, None))
            except (OllamaError, Refused) as e:  # failed after the stream began: a line
                if isinstance(e, Refused):
                    failed = e.problem.message if e.problem.status < 500 else FAILED
                else:
                    failed = e.message if e.status < 500 else FAILED
            tg.cancel_scope.cancel()
        if left.is_set():
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        rec = current()
        if failed is not None:
            body = _line({"error": failed})
        else:
            await run_in_threadpool(close_chunks, chunks)  # the generation closed: its counts whole
            reason = "length" if finish == "length" else "stop"
            if rec is not None:
                rec.stop_reason = reason
            context = None if call.chat else _context(rec)
            body = _line(self._final(call, reason, context, rec))
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    # -- answers -----------------------------------------------------------------------------

    def _line(self, call: OllamaCall, text: str) -> dict[str, Any]:
        return {"model": call.model, "created_at": timestamp(), "done": False}

    def _piece(self, call: OllamaCall, text: str, calls: list[Any]) -> dict[str, Any]:
        if not call.chat:
            return {"response": text}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return {"message": message}

    def _final(
        self,
        call: OllamaCall,
        reason: str,
        context: list[int] | None,
        rec: RequestRecord | None,
    ) -> dict[str, Any]:
        out: dict[str, Any] = {"model": call.model, "created_at": timestamp()}
        out.update(self._piece(call, "", []))
        out.update(done=True, done_reason=reason)
        if reason == "load":
            return out
        out.update(timings(rec))
        if context is not None:
            out["context"] = context
        return out


def timings(rec: RequestRecord | None) -> dict[str, int]:
    """Ollama's timing fields, in nanoseconds, from the request's generations (the meter's)."""
    now = perf_counter_ns()
    if rec is None or not rec.generations:
        return {
            "total_duration": 0,
            "load_duration": 0,
            "prompt_eval_count": 0,
            "prompt_eval_duration": 0,
            "eval_count": 0,
            "eval_duration": 0,
        }
    gens = rec.generations
    return {
        "total_duration": now - rec.start_ns,
        "load_duration": max(0, gens[0].opened_ns - rec.start_ns),
        "prompt_eval_count": len(gens[0].prompt),
        "prompt_eval_duration": sum(g.phases["prefill"].ns for g in gens),
        "eval_count": sum(len(g.generated) for g in gens),
        "eval_duration": sum(g.phases["decode"].ns for g in gens),
    }


def _context(rec: RequestRecord | None) -> list[int]:
    """The conversation's tokens after a generation: its prompt's and those it sampled."""
    if rec is None or not rec.generations:
        return []
    gen = rec.generations[-1]
    return [*gen.prompt, *gen.generated]


def _tool_call(tc: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-form call as Ollama's: the arguments an object."""
    fn = tc.get("function") or {}
    text = fn.get("arguments") or "{}"
    try:
        args = json.loads(text)
    except ValueError:
        from jiter import from_json

        try:  # a call cut short: its arguments as far as they go
            args = from_json(text.encode("utf-8"), partial_mode=True)
        except ValueError:
            args = {}
    return {
        "function": {
            "name": fn.get("name", ""),
            "arguments": args if isinstance(args, dict) else {},
        }
    }


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\n"


async def _start(send: Send) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", NDJSON), (b"cache-control", b"no-cache")],
        }
    )


async def _run(fn: Any) -> Any:
    """``fn`` in a worker thread, its failures as Ollama errors (no traceback); a ``Refused``
    goes on for the guard to answer (in this API's shape)."""
    try:
        return await run_in_threadpool(fn)
    except (OllamaError, Refused):
        raise
    except ValueError as e:  # llama-cpp-python's "Requested tokens (N) exceed context window"
        raise OllamaError(400, str(e)) from None
    except Exception:
        raise OllamaError(500, FAILED) from None


def add_ollama(
    app: Any,
    llm: Any,
    names: ModelNames,
    routes: dict[str, Route],
    checks: RequestChecks,
    facts: OllamaModelFacts,
    embedder: Embedder,
) -> None:
    """The Ollama routes on ``app``, and in the guard's table ``routes`` with their checks
    (chat, generate and embed queue for the model and count in ``/metrics``)."""
    from starlette.routing import Route as StarletteRoute

    endpoint = OllamaApi(llm=llm, names=names, checks=checks, facts=facts, embedder=embedder)
    post, get = frozenset({"POST"}), frozenset({"GET"})
    table = [
        Route(CHAT, post, partial(endpoint.check, chat=True), counted=True, budget=budget),
        Route(GENERATE, post, partial(endpoint.check, chat=False), counted=True, budget=budget),
        Route("/api/show", post, endpoint.check_model),
        Route(EMBED, post, partial(endpoint.check_embed, legacy=False), counted=True),
        Route(LEGACY, post, partial(endpoint.check_embed, legacy=True), counted=True),
        Route("/api/tags", get),
        Route("/api/ps", get),
        Route("/api/version", get),
    ]
    for route in table:
        methods = sorted(route.methods | ({"HEAD"} if "GET" in route.methods else set()))
        app.router.routes.insert(0, StarletteRoute(route.path, endpoint, methods=methods))
        routes[route.path] = route
