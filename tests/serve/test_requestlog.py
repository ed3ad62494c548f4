"""The request log without a model: a request's record meets the generations filed under it
(through the context the application runs in), is summed up once both its response and its
generations are over, whichever ends last, and is one line of text or one JSON object; the
middleware takes the status and an OpenAI answer's finish_reason from the response, adds the
``request-id`` header, and leaves the watchers' polls out."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("starlette", reason="moepack[serve] is installed by ./dev test")

from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, Response  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from moepack.serve.meter import ServedGeneration  # noqa: E402
from moepack.serve.requestlog import CURRENT, RequestLog, RequestLogging, line  # noqa: E402


def _generation(log: RequestLog, prompt: int, prefill: int, generated: int) -> ServedGeneration:
    gen = ServedGeneration(0, list(range(prompt)))
    log.on_open(gen)
    gen.phases["prefill"].tokens = prefill
    gen.phases["decode"].tokens, gen.phases["decode"].ns = generated - 1, 500_000_000
    gen.phases["decode"].read_bytes = 4_000_000 * (generated - 1)
    gen.generated = list(range(generated))
    gen.first_token_ns = gen.opened_ns + 250_000_000
    gen.prefetch = {"demand_hits": 30.0, "demand_experts": 40.0}
    return gen


def test_a_record_is_summed_up_once_its_response_and_its_generation_are_over():
    got: list[dict[str, Any]] = []
    log = RequestLog(got.append)
    rec = log.begin("anthropic", "/v1/messages", "POST")
    token = CURRENT.set(rec)
    try:
        gen = _generation(log, prompt=120, prefill=20, generated=11)
    finally:
        CURRENT.reset(token)
    rec.status, rec.stop_reason = 200, "end_turn"
    log.end(rec)  # the client has its answer; the generation is still open
    assert got == []
    log.on_finish(gen)
    (s,) = got
    assert s["id"] == "req_1" and s["prompt_tokens"] == 120 and s["reused_tokens"] == 100
    assert s["generated_tokens"] == 11 and s["decode_tokens_per_second"] == 20.0
    assert s["decode_mb_per_token"] == 4.0 and s["expert_hit_ratio"] == 0.75
    assert s["ttft_seconds"] >= 0.25
    assert log.ttft()[0] == s["ttft_seconds"]
    text = line(s)
    assert text.startswith("req_1 anthropic POST /v1/messages 200: prompt 120 (100 reused), ")
    assert (
        "generated 11, " in text
        and "decode 20.0 tok/s, 4.00 MB/tok, hit 75%, stop end_turn" in text
    )
    # a request that ran no generation: its status and time
    other = log.begin("anthropic", "/v1/messages/count_tokens", "POST")
    other.status = 200
    log.end(other)
    assert got[-1]["prompt_tokens"] is None and line(got[-1]).endswith(" s)")


def test_the_middleware_reads_the_answer_and_leaves_the_polls_out():
    got: list[dict[str, Any]] = []
    log = RequestLog(got.append)

    async def chat(request: Request) -> Response:
        assert CURRENT.get() is not None  # the application runs in the request's context
        return JSONResponse({"choices": [{"finish_reason": "length"}]})

    async def page(request: Request) -> Response:
        return Response("<html></html>", media_type="text/html")

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                            Route("/", page), Route("/metrics.json", page)])  # fmt: skip
    with TestClient(RequestLogging(app, log=log)) as client:
        r = client.post("/v1/chat/completions", json={})
        assert r.headers["request-id"] == "req_1"
        client.get("/")
        client.get("/metrics.json")
        client.post("/nowhere", json={})
    assert [(s["api"], s["route"], s["status"], s["stop_reason"]) for s in got] == [
        ("openai", "/v1/chat/completions", 200, "length"),
        ("other", "/nowhere", 404, None),
    ]
