"""``/v1/messages`` through the official ``anthropic`` client against a served synthetic model
(one server with ``--api-key``, ``--log-json`` and ``--max-queue 1``; one with
``chatml-function-calling`` and ``--trace-out``): plain and streamed (the same text at
temperature 0), system prompts, multi-turn, stop sequences, the max_tokens stop, count_tokens
equal to a request's input tokens, tool calls named and automatic and their results
round-tripped, every bad request in Anthropic's error shape, the key required of both APIs, a
full queue answered 429, a client leaving mid-stream, the requests traced, and the same
conversation giving the same text through ``/v1/chat/completions``."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from moefixtures import tiny_spec
from moepack.checkpoint.synth import synth_model
from served import Served, logit_bias

pytest.importorskip("llama_cpp.server", reason="moepack[serve] is installed by ./dev test")
anthropic = pytest.importorskip("anthropic", reason="the test extra installs the anthropic client")
openai = pytest.importorskip("openai", reason="the test extra installs the openai client")
pytestmark = pytest.mark.slow

KEY = "sk-test-moepack"
CTX = 2048
USER = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog"}]
TOOL = {
    "name": "weather",
    "description": "the weather in a city",
    "input_schema": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
                     "required": ["unit"]},
}  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    spec = tiny_spec(layers=4, experts=32, top_k=4, hidden=256, expert_ffn=256, weight_type="Q8_0")
    return synth_model(tmp_path_factory.mktemp("anthropic") / "m.gguf", spec).paths[0]


@pytest.fixture(scope="module")
def server(model) -> Iterator[Served]:
    with Served(model, "--ctx", CTX, "--threads", 1, "--api-key", KEY, "--log-json",
                "--max-queue", 1) as s:  # fmt: skip
        yield s


@pytest.fixture(scope="module")
def client(server) -> Any:
    return anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def greedy(model) -> dict[str, Any]:
    """Temperature 0 and ASCII text (``logit_bias``: see ``served.logit_bias``), as llama-cpp-
    python's own fields in the body (the 2026 client has no sampling parameters)."""
    return {"temperature": 0, "logit_bias": logit_bias(model)}


def _text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_plain_and_streamed_give_the_same_text(client, greedy, server):
    m = client.messages.create(model="m", max_tokens=24, messages=USER, extra_body=greedy)
    assert m.type == "message" and m.role == "assistant" and m.model == "m"
    assert m.id.startswith("msg_") and m.stop_reason in ("end_turn", "max_tokens")
    assert _text(m) and m.usage.input_tokens > 0 and m.usage.output_tokens > 0
    events = []
    with client.messages.stream(model="m", max_tokens=24, messages=USER, extra_body=greedy) as s:
        for ev in s:
            events.append(ev.type)
        final = s.get_final_message()
    assert _text(final) == _text(m)
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens
    assert final.usage.input_tokens == m.usage.input_tokens
    kinds = [e for e in events if e not in ("text",)]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    # the raw stream: Anthropic's event names, a ping after message_start
    raw = _post(server, "/v1/messages", {"model": "m", "max_tokens": 4, "messages": USER,
                                         "stream": True, **greedy})[1]  # fmt: skip
    names = [ln.removeprefix("event: ") for ln in raw.splitlines() if ln.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"], names
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "content_block_delta" in names


def test_max_tokens_stop_and_usage(client, model):
    endless = {"temperature": 0, "logit_bias": logit_bias(model, endless=True)}
    m = client.messages.create(model="m", max_tokens=7, messages=USER, extra_body=endless)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 7
    count = client.messages.count_tokens(model="m", messages=USER)
    assert count.input_tokens == m.usage.input_tokens


def test_system_and_multi_turn_change_the_prompt_as_counted(client, greedy):
    alone = client.messages.count_tokens(model="m", messages=USER).input_tokens
    system = client.messages.count_tokens(model="m", messages=USER,
                                          system="you are terse").input_tokens  # fmt: skip
    blocks = client.messages.count_tokens(
        model="m", messages=USER, system=[{"type": "text", "text": "you are terse"}]
    ).input_tokens
    assert system > alone and blocks == system
    first = client.messages.create(model="m", max_tokens=8, messages=USER, extra_body=greedy)
    turns = [*USER, {"role": "assistant", "content": _text(first)},
             {"role": "user", "content": [{"type": "text", "text": "and then?"}]}]  # fmt: skip
    second = client.messages.create(model="m", max_tokens=8, messages=turns, system="you are terse",
                                    extra_body=greedy)  # fmt: skip
    assert second.usage.input_tokens == client.messages.count_tokens(
        model="m", messages=turns, system="you are terse").input_tokens  # fmt: skip
    assert second.usage.input_tokens > system


def test_stop_sequences(client, greedy):
    free = _text(client.messages.create(model="m", max_tokens=24, messages=USER, extra_body=greedy))
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    assert stop.strip(), free
    m = client.messages.create(model="m", max_tokens=24, messages=USER, stop_sequences=[stop],
                               extra_body=greedy)  # fmt: skip
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert free.startswith(_text(m)) and stop not in _text(m)


def test_a_tool_call_and_its_result_round_trip(client, greedy, server):
    m = client.messages.create(model="m", max_tokens=48, messages=USER, tools=[TOOL],
                               tool_choice={"type": "tool", "name": "weather"},
                               extra_body=greedy)  # fmt: skip
    assert m.stop_reason == "tool_use"
    (call,) = [b for b in m.content if b.type == "tool_use"]
    assert (
        call.name == "weather" and call.input["unit"] in ("c", "f") and call.id.startswith("toolu_")
    )
    turns = [*USER, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                           "content": "sunny, 21 degrees"}]}]  # fmt: skip
    kw = {"model": "m", "messages": turns, "tools": [TOOL], "tool_choice": {"type": "none"}}
    reply = client.messages.create(max_tokens=8, extra_body=greedy, **kw)
    assert reply.stop_reason in ("end_turn", "max_tokens") and _text(reply)
    # the result reached the prompt: it counts, and the request counted it the same way
    without = client.messages.count_tokens(model="m", messages=[*USER, {"role": "user",
                                           "content": "x"}]).input_tokens  # fmt: skip
    counted = client.messages.count_tokens(**kw).input_tokens
    assert counted == reply.usage.input_tokens and counted > without


def test_bad_requests_get_anthropic_errors_and_the_server_lives_on(client, server):
    def status_of(**kw: Any) -> tuple[int, dict[str, Any]]:
        with pytest.raises(anthropic.APIStatusError) as e:
            client.messages.create(**{"model": "m", "max_tokens": 4, "messages": USER, **kw})
        body = e.value.body
        assert isinstance(body, dict) and body["type"] == "error", body
        return e.value.status_code, body["error"]

    image = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": "iVBORw0KGgo="}}]  # fmt: skip
    cases: list[tuple[dict[str, Any], int, str, str]] = [
        ({"model": "claude-opus-4"}, 404, "not_found_error", "claude-opus-4"),
        ({"messages": [{"role": "user", "content": image}]}, 400, "invalid_request_error",
         "takes text"),
        ({"tools": [TOOL]}, 400, "invalid_request_error", "chatml-function-calling"),
        ({"tools": [TOOL, {**TOOL, "name": "other"}], "tool_choice": {"type": "any"}}, 400,
         "invalid_request_error", "'any'"),
        ({"max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
        ({"messages": [*USER, {"role": "assistant", "content": "so"}]}, 400,
         "invalid_request_error", "last message"),
        ({"messages": [{"role": "user", "content": "word " * CTX}]}, 400,
         "invalid_request_error", "context window"),
        ({"messages": [{"role": "user", "content": "word " * CTX}], "stream": True}, 400,
         "invalid_request_error", "context window"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400,
         "invalid_request_error", "thinking"),
    ]  # fmt: skip
    for kw, status, kind, words in cases:
        if kw.get("stream"):
            kw = {k: v for k, v in kw.items() if k != "stream"}
            stream = client.messages.stream(model="m", max_tokens=4, **{"messages": USER, **kw})
            with pytest.raises(anthropic.APIStatusError) as e, stream:
                pass
            got = (e.value.status_code, e.value.body["error"])
        else:
            got = status_of(**kw)
        assert got[0] == status and got[1]["type"] == kind and words in got[1]["message"], (kw, got)
    for raw, status in ((b"{not json", 400), (b"[1]", 400), (b"", 400)):
        code, text = _post(server, "/v1/messages", raw)
        assert code == status and json.loads(text)["type"] == "error", text
    code, text = _post(server, "/v1/messages", {"model": "m", "messages": USER})
    assert code == 400 and "max_tokens" in json.loads(text)["error"]["message"]
    code, text = _request(server, "/v1/messages", None, "GET")
    assert code == 405 and json.loads(text)["error"]["type"] == "invalid_request_error"
    code, text = _post(server, "/v1/messages/batches", {})
    assert code == 404 and json.loads(text)["error"]["type"] == "not_found_error"
    # the key: required of both APIs, in either header
    for headers in ({}, {"x-api-key": "wrong"}):
        code, text = _post(server, "/v1/messages", {"model": "m", "max_tokens": 2,
                                                    "messages": USER}, headers)  # fmt: skip
        assert code == 401 and json.loads(text)["error"]["type"] == "authentication_error"
        code, text = _post(server, "/v1/chat/completions", {"messages": USER}, headers)
        assert code == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
    assert server.get("/metrics")[0] == 200 and server.get("/")[0] == 200  # open to watch
    oa = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)
    assert [m.id for m in oa.models.list()] == ["m"]  # a bearer token on the Anthropic side too
    code, _ = _post(server, "/v1/messages/count_tokens", {"model": "m", "messages": USER},
                    {"authorization": f"Bearer {KEY}"})  # fmt: skip
    assert code == 200
    assert _text(client.messages.create(model="m", max_tokens=4, messages=USER))


def test_the_same_conversation_reads_the_same_through_both_apis(client, greedy, server):
    turns = [*USER, {"role": "assistant", "content": "a fox"},
             {"role": "user", "content": "and the dog?"}]  # fmt: skip
    m = client.messages.create(model="m", max_tokens=16, system="be brief", messages=turns,
                               stop_sequences=["zz"], extra_body=greedy)  # fmt: skip
    oa = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)
    chat = oa.chat.completions.create(
        model="m", max_tokens=16, temperature=0, stop=["zz"], logit_bias=greedy["logit_bias"],
        messages=[{"role": "system", "content": "be brief"}, *turns],
    )  # fmt: skip
    assert chat.choices[0].message.content == _text(m)
    assert chat.usage.prompt_tokens == m.usage.input_tokens
    # both were logged, one JSON object each, and /metrics counted the Anthropic requests
    logged = [json.loads(line) for line in server.requests()]
    apis = {(r["api"], r["route"]) for r in logged}
    assert ("anthropic", "/v1/messages") in apis and ("openai", "/v1/chat/completions") in apis
    last = [r for r in logged if r["route"] == "/v1/messages" and r["status"] == 200][-1]
    assert last["prompt_tokens"] > 0 and last["stop_reason"] in ("end_turn", "max_tokens")
    metrics = server.wait_idle()
    assert metrics['moepack_requests_total{code="200",path="/v1/messages"}'] >= 5


def _post(
    server: Served, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return _request(server, path, data, "POST", headers)


def _request(
    server: Served,
    path: str,
    data: bytes | None,
    method: str,
    headers: dict[str, str] | None = None,
) -> tuple[int, str]:
    sent = {"content-type": "application/json", "x-api-key": KEY} if headers is None else {
        "content-type": "application/json", **headers}  # fmt: skip
    req = urllib.request.Request(server.base + path, data=data, headers=sent, method=method)
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_a_client_that_leaves_mid_stream_stops_its_generation(client, model, server):
    endless = {"temperature": 0, "logit_bias": logit_bias(model, endless=True)}
    before = server.wait_idle()['moepack_tokens_total{phase="decode"}']
    with client.messages.stream(model="m", max_tokens=1500, messages=USER,
                                extra_body=endless) as stream:  # fmt: skip
        for n, _ in enumerate(stream.text_stream):
            if n == 3:
                break
    decoded = server.wait_idle()['moepack_tokens_total{phase="decode"}'] - before
    assert 0 < decoded < 750  # stopped long before the end it asked for
    assert _text(client.messages.create(model="m", max_tokens=4, messages=USER))


def test_a_full_queue_is_429_in_each_api_shape(client, model, server):
    endless = {"temperature": 0, "logit_bias": logit_bias(model, endless=True)}
    long = {"model": "m", "max_tokens": 1500, "messages": USER, "extra_body": endless}
    running = client.messages.stream(**long).__enter__()  # generating
    events = iter(running)
    next(events)
    waiting: list[Any] = []
    thread = threading.Thread(target=lambda: waiting.append(client.messages.create(
        model="m", max_tokens=2, messages=USER)), daemon=True)  # fmt: skip
    thread.start()
    deadline = time.monotonic() + 120
    while server.metrics()["moepack_requests_in_flight"] < 2:  # one runs, one waits
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert server.metrics()["moepack_requests_queued"] == 1
    with pytest.raises(anthropic.RateLimitError) as e:
        anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0).messages.create(
            model="m", max_tokens=2, messages=USER)  # fmt: skip
    assert e.value.body["error"]["type"] == "rate_limit_error"
    assert e.value.response.headers["retry-after"] == "1"
    code, text = _post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 2})
    assert code == 429 and json.loads(text)["error"]["code"] == "rate_limit_exceeded"
    code, text = _post(server, "/v1/messages/count_tokens", {"model": "m", "messages": USER})
    assert code == 429  # counting renders and tokenises on the model: it waits its turn too
    assert json.loads(text)["error"]["type"] == "rate_limit_error"
    running.close()
    thread.join(timeout=600)
    assert waiting and waiting[0].content is not None  # the one waiting was answered


# -- a chat format with automatic tool choice, traced ------------------------------------------


@pytest.fixture(scope="module")
def traced(model, tmp_path_factory) -> Iterator[tuple[Served, Path]]:
    out = tmp_path_factory.mktemp("traced") / "served.moetrace"
    with Served(model, "--ctx", CTX, "--threads", 1, "--chat-format", "chatml-function-calling",
                "--trace-out", out) as s:  # fmt: skip
        yield s, out


def test_automatic_tool_choice_plain_and_streamed_and_the_trace_counts_it(traced, greedy):
    server, out = traced
    c = anthropic.Anthropic(base_url=server.base, api_key="none", max_retries=0, timeout=600)
    for question in ("what is the weather", "the weather in paris please"):
        kw = {"model": "m", "max_tokens": 24, "tools": [TOOL], "extra_body": greedy,
              "messages": [{"role": "user", "content": question}]}  # fmt: skip
        m = c.messages.create(**kw)
        with c.messages.stream(**kw) as s:
            for _ in s:
                pass
            streamed = s.get_final_message()
        assert streamed.stop_reason == m.stop_reason
        assert [b.type for b in streamed.content] == [b.type for b in m.content]
        for a, b in zip(streamed.content, m.content, strict=True):
            assert (a.text if a.type == "text" else a.input) == (
                b.text if b.type == "text" else b.input
            )
        if (
            m.stop_reason == "tool_use"
        ):  # its result back, as a plain turn (the format drops tool results)
            (call,) = [b for b in m.content if b.type == "tool_use"]
            turns = [*kw["messages"], {"role": "assistant", "content": [b.model_dump() for b in m.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": "sunny, 21 degrees"}]}]  # fmt: skip
            reply = c.messages.create(**{**kw, "messages": turns})
            assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
            counted = c.messages.count_tokens(model="m", messages=turns, tools=[TOOL]).input_tokens
            assert counted == reply.usage.input_tokens
        else:
            assert _text(m)  # a message's text is not held to a function name's grammar
    # a streamed call of a named tool: its input arrives whole
    kw = {"model": "m", "max_tokens": 32, "tools": [TOOL], "extra_body": greedy, "messages": USER,
          "tool_choice": {"type": "tool", "name": "weather"}}  # fmt: skip
    with c.messages.stream(**kw) as s:
        for _ in s:
            pass
        (call,) = s.get_final_message().content
    assert call.type == "tool_use" and call.input == c.messages.create(**kw).content[0].input
    generations = server.wait_idle()["moepack_generations_total"]
    code, lines = server.stop()
    (line,) = lines
    assert line.startswith("moepack: stopped; the server answered ")
    assert line.endswith(f" requests; wrote {out} (complete)")
    from moepack.trace.formats import load_trace

    assert len(load_trace(out).prompt_segments) == generations  # every generation, traced
