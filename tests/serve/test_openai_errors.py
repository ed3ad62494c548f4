"""The guard and the OpenAI error middleware on a real Starlette application streaming with
sse-starlette as llama-cpp-python's routes do (a publisher task feeding a memory channel),
driven through ASGI: a failure before the first event is a 4xx in OpenAI's shape, one after it
an ``error`` event that says nothing of the server's insides; bodies that are not JSON, unknown
models, negative ``max_tokens`` and fields the request type refuses are 4xx before the
application runs; requests are counted in flight and answered."""

from __future__ import annotations

import json
from collections.abc import MutableMapping
from typing import Any

import pytest

pytest.importorskip("llama_cpp.server", reason="moepack[serve] is installed by ./dev test")

import anyio  # noqa: E402
from sse_starlette.sse import EventSourceResponse  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, Response  # noqa: E402
from starlette.routing import Route  # noqa: E402

from moepack.serve.checks import Limits, Vocabulary  # noqa: E402
from moepack.serve.guard import Guard  # noqa: E402
from moepack.serve.guard import Route as Guarded  # noqa: E402
from moepack.serve.metrics import RequestCounts  # noqa: E402
from moepack.serve.names import ModelNames
from moepack.serve.openai_errors import OpenAIErrors  # noqa: E402
from moepack.serve.shapes import ApiProblem, Shapes  # noqa: E402
from moepack.serve.validate import BodyChecks  # noqa: E402

PATH = "/v1/chat/completions"
OVERFLOW = "Requested tokens (600) exceed context window of 512"


async def chat(request: Request) -> Response:
    body = await request.json()
    fail = body.get("fail")
    if not body.get("stream"):
        return JSONResponse({"choices": [{"message": {"content": "hi"}}]})
    send, receive = anyio.create_memory_object_stream[dict[str, str]](10)

    async def publish() -> None:
        async with send:
            if fail == "early":
                raise ValueError(OVERFLOW)
            await send.send({"data": "one"})
            if fail == "late":
                raise RuntimeError("llama_decode returned -1")
            await send.send({"data": "[DONE]"})

    return EventSourceResponse(receive, data_sender_callable=publish, sep="\n")


def _no_grammar(grammar: str) -> str | None:
    raise AssertionError("these requests hold no grammar")


def _app(logprobs: bool = True) -> tuple[Guard, RequestCounts]:
    from llama_cpp.server.app import router
    from llama_cpp.server.types import CreateChatCompletionRequest

    wording = router.routes[0]
    counts = RequestCounts()

    def describe(exc: Exception, body: Any) -> ApiProblem:
        status, e = wording.error_message_wrapper(error=exc, body=body)  # type: ignore[attr-defined]
        return ApiProblem(int(status), e["message"], e["param"], e["code"], e["type"])

    app = Starlette(routes=[Route(PATH, chat, methods=["POST"])])
    inner = OpenAIErrors(app, requests={PATH: CreateChatCompletionRequest}, describe=describe)
    requests = BodyChecks(
        Vocabulary(n_vocab=262, longest_piece=8, grammar=_no_grammar),
        Limits(n_ctx=512, max_prompt_tokens=512, logprobs=logprobs),
        ModelNames.of([], "m"),
    )
    routes = {PATH: Guarded(PATH, frozenset({"POST"}), requests.chat, counted=True)}
    return Guard(inner, routes=routes, shapes=Shapes(), counts=counts), counts


def _call(app: Guard, body: bytes) -> tuple[int, bytes]:
    """One POST through ASGI; the status and the whole body the client receives."""
    sent: list[MutableMapping[str, Any]] = []

    async def go() -> None:
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        done = anyio.Event()

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await done.wait()  # the client stays until the response ends
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                done.set()

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": PATH, "raw_path": PATH.encode(), "root_path": "",
            "query_string": b"", "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
        }  # fmt: skip
        await app(scope, receive, send)

    anyio.run(go)
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) == 1, sent
    assert sent[-1]["type"] == "http.response.body" and not sent[-1].get("more_body")
    return int(starts[0]["status"]), b"".join(m.get("body", b"") for m in sent[1:])


def _request(**extra: Any) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    ).encode()


def test_a_stream_that_fails_before_its_first_event_is_a_4xx_in_openai_shape():
    app, counts = _app()
    status, body = _call(app, _request(stream=True, fail="early"))
    assert status == 400
    error = json.loads(body)["error"]
    assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}
    status, body = _call(app, _request(stream=True))
    assert status == 200 and body == b"data: one\n\ndata: [DONE]\n\n"
    assert counts.in_flight == 0 and counts.answered == {(PATH, 400): 1, (PATH, 200): 1}


def test_a_stream_that_fails_after_its_first_event_ends_with_an_error_event():
    app, _counts = _app()
    status, body = _call(app, _request(stream=True, fail="late"))
    assert status == 200
    first, second = body.split(b"\n\n")[:2]
    assert first == b"data: one"
    error = json.loads(second.removeprefix(b"data: "))["error"]
    # the exception's text stays in the server
    assert error["type"] == "server_error" and "llama_decode" not in error["message"]


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        (b"{not json", 400, None, None),
        (b"[1, 2]", 400, None, None),
        (_request(model="gpt-4o"), 404, "model", "model_not_found"),
        (_request(max_tokens=-1), 400, "max_tokens", "integer_below_min_value"),
        (_request(temperature="hot"), 400, "temperature", "float_parsing"),
        (_request(messages="hi"), 400, "messages", "list_type"),
    ],
)
def test_bad_bodies_are_4xx_before_the_application_runs(body, status, param, code):
    app, counts = _app()
    got, answer = _call(app, body)
    error = json.loads(answer)["error"]
    assert (got, error["param"], error["code"]) == (status, param, code), error
    assert error["type"] == "invalid_request_error" and error["message"]
    assert counts.in_flight == 0 and counts.answered == {(PATH, status): 1}


def test_a_plain_request_passes_through():
    app, _counts = _app()
    status, body = _call(app, _request())
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "hi"


def test_logprobs_are_refused_where_the_logits_are_not_kept():
    kept, _ = _app(logprobs=True)
    assert _call(kept, _request(logprobs=True))[0] == 200
    dropped, _ = _app(logprobs=False)
    assert _call(dropped, _request(logprobs=False))[0] == 200
    status, body = _call(dropped, _request(logprobs=True))
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "logprobs" and "--trace-out" in error["message"]
