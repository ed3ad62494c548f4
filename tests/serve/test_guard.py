"""The guard in front of a real Starlette application, driven through ASGI: paths and methods
the server does not answer, bodies that are not JSON or too large or too deep or not text, and
failures of the application, each a 4xx or a 500 in the shape of the path's API, with nothing
of the server's insides in it."""

from __future__ import annotations

import json
from collections.abc import MutableMapping
from typing import Any

import pytest

pytest.importorskip("starlette", reason="moepack[serve] is installed by ./dev test")

import anyio  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, PlainTextResponse, Response  # noqa: E402
from starlette.routing import Route  # noqa: E402

from moepack.serve.guard import MAX_DEPTH, PARSED, Guard, parse_json  # noqa: E402
from moepack.serve.guard import Route as Guarded  # noqa: E402
from moepack.serve.metrics import RequestCounts  # noqa: E402
from moepack.serve.shapes import ApiProblem, Refused, Shapes  # noqa: E402

CAP = 1000


async def echo(request: Request) -> Response:
    return JSONResponse({"got": request.scope[PARSED], "raw": (await request.body()).decode()})


async def fails(request: Request) -> Response:
    raise RuntimeError("/secret/path/llama.py line 12: boom")


async def words_500(request: Request) -> Response:  # llama-cpp-python's RouteErrorHandler
    error = {"message": "Traceback: /secret/path", "type": "internal_server_error"}
    return JSONResponse({"error": {**error, "param": None, "code": None}}, status_code=500)


async def refuses(request: Request) -> Response:
    raise Refused(ApiProblem(503, "the server is stopping", code="server_stopping"))


async def fastapi_422(request: Request) -> Response:
    detail = [{"loc": ["body", "input"], "msg": "Input should be a valid string", "type": "t"}]
    return JSONResponse({"detail": detail}, status_code=422)


async def plain_500(request: Request) -> Response:
    return PlainTextResponse("Internal Server Error", status_code=500)


def _check(data: Any) -> tuple[ApiProblem | None, Any]:
    if isinstance(data, dict) and data.get("drop") is None and "drop" in data:
        return None, {k: v for k, v in data.items() if k != "drop"}
    return None, data


def _guard(shapes: Shapes | None = None) -> tuple[Guard, RequestCounts]:
    paths = {
        "/echo": echo,
        "/fails": fails,
        "/words": words_500,
        "/refuses": refuses,
        "/422": fastapi_422,
        "/plain": plain_500,
        "/other/echo": echo,
    }
    app = Starlette(routes=[Route(p, f, methods=["POST"]) for p, f in paths.items()])
    routes = {p: Guarded(p, frozenset({"POST"}), _check, counted=p == "/echo") for p in paths}
    routes["/get"] = Guarded("/get", frozenset({"GET"}))
    counts = RequestCounts()
    return Guard(app, routes=routes, shapes=shapes or Shapes(), counts=counts, max_body=CAP), counts


def _call(
    app: Guard,
    path: str,
    body: bytes | list[bytes] = b"{}",
    method: str = "POST",
    headers: list[tuple[bytes, bytes]] | None = None,
) -> tuple[int, dict[str, str], bytes, int]:
    """One request through ASGI: status, headers, body, and how many body chunks were read."""
    chunks = body if isinstance(body, list) else [body]
    sent: list[MutableMapping[str, Any]] = []
    read = [0]

    async def go() -> None:
        async def receive() -> dict[str, Any]:
            if read[0] < len(chunks):
                read[0] += 1
                more = read[0] < len(chunks)
                return {"type": "http.request", "body": chunks[read[0] - 1], "more_body": more}
            await anyio.sleep_forever()
            raise AssertionError

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)

        given = [(b"content-type", b"application/json")] if headers is None else headers
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": given,
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2),
        }
        await app(scope, receive, send)

    anyio.run(go)
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) == 1, sent
    assert sent[-1]["type"] == "http.response.body" and not sent[-1].get("more_body")
    heads = {k.decode(): v.decode() for k, v in starts[0]["headers"]}
    return int(starts[0]["status"]), heads, b"".join(m.get("body", b"") for m in sent[1:]), read[0]


def _error(body: bytes) -> dict[str, Any]:
    data = json.loads(body)
    assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}
    return dict(data["error"])


def test_unknown_paths_and_methods_are_404_and_405_in_openai_shape():
    app, _ = _guard()
    status, _, body, _ = _call(app, "/nowhere")
    assert status == 404 and _error(body)["message"] == "Invalid URL (POST /nowhere)"
    status, heads, body, _ = _call(app, "/echo", method="GET")
    assert status == 405 and heads["allow"] == "POST" and "GET" in _error(body)["message"]
    status, _, _, _ = _call(app, "/get", method="HEAD")
    assert status != 405


@pytest.mark.parametrize(
    "content_type", [None, b"text/plain", b"application/x-www-form-urlencoded", b"multipart/x"]
)
def test_a_body_not_declared_json_is_415_unread(content_type):
    app, _ = _guard()
    headers = [] if content_type is None else [(b"content-type", content_type)]
    status, _, body, read = _call(app, "/echo", b'{"a": 1}', headers=headers)
    assert status == 415 and _error(body)["code"] == "unsupported_media_type" and read == 0


def test_a_body_over_the_cap_is_413_before_it_is_read():
    app, counts = _guard()
    declared = [(b"content-type", b"application/json"), (b"content-length", b"50000000")]
    status, _, body, read = _call(app, "/echo", [b"x" * 100] * 5, headers=declared)
    assert status == 413 and "50,000,000 bytes" in _error(body)["message"] and read == 0
    # no Content-Length: refused once what arrived passes the cap, the rest never read
    status, _, body, read = _call(app, "/echo", [b" " * 400] * 10)
    assert status == 413 and _error(body)["code"] == "request_too_large" and read == 3
    assert counts.answered == {("/echo", 413): 2} and counts.in_flight == 0


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"{not json", "not valid JSON"),
        (b"", "empty"),
        (b'{"t": NaN}', "NaN"),
        (b'{"t": -Infinity}', "-Infinity"),
        (b'{"t": 1e999}', "too large"),
        (b'{"p": "\\ud800"}', "surrogate"),
        (b'{"\\udfff": 1}', "surrogate"),
        (b"[" * 100_000 + b"]" * 100_000, f"deeper than {MAX_DEPTH}"),
        (b'{"a":' * (MAX_DEPTH + 1) + b"1" + b"}" * (MAX_DEPTH + 1), "deeper"),
    ],
)
def test_bodies_that_are_not_json_text_are_400(raw, words):
    problem, _ = parse_json(raw)
    assert problem is not None and problem.status == 400 and words in problem.message
    app, _ = _guard()
    app.max_body = 1 << 20
    status, _, body, _ = _call(app, "/echo", raw)
    assert status == 400 and words in _error(body)["message"]


def test_json_at_the_depth_bound_and_a_checked_body_reach_the_route():
    nested = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert parse_json(nested)[0] is None
    app, _ = _guard()
    status, _, body, _ = _call(app, "/echo", b'{"keep": "\\u00e9", "drop": null}')
    assert status == 200
    got = json.loads(body)
    assert got["got"] == {"keep": "é"} and json.loads(got["raw"]) == {"keep": "é"}


def test_failures_of_the_application_say_nothing_of_its_insides():
    app, _ = _guard()
    for path in ("/fails", "/words", "/plain"):
        status, _, body, _ = _call(app, path)
        error = _error(body)
        assert status == 500 and error["type"] == "server_error", path
        assert "secret" not in body.decode() and "Traceback" not in body.decode()
    status, _, body, _ = _call(app, "/refuses")
    assert status == 503 and _error(body)["code"] == "server_stopping"
    status, _, body, _ = _call(app, "/422")
    error = _error(body)
    assert status == 400 and error["param"] == "input" and "valid string" in error["message"]


class _OtherShape:
    def body(self, problem: ApiProblem) -> dict[str, Any]:
        return {"type": "error", "error": {"type": problem.kind, "message": problem.message}}


def test_an_api_registered_under_a_prefix_gets_its_own_error_shape():
    shapes = Shapes()
    shapes.register("/other/", _OtherShape())
    app, _ = _guard(shapes)
    status, _, body, _ = _call(app, "/other/echo", b"[")
    assert status == 400 and json.loads(body)["type"] == "error"
    assert "not valid JSON" in json.loads(body)["error"]["message"]
    status, _, body, _ = _call(app, "/echo", b"[")
    assert status == 400 and _error(body)
