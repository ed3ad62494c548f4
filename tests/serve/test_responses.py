"""OpenAI's Responses API (``/v1/responses``) through the official ``openai`` client against a
served synthetic model: plain and streamed give the same text and usage, the event sequence
numbered, ``max_output_tokens`` ending it ``incomplete``, instructions and turns in the prompt,
a named function call, ``text.format`` as JSON or a JSON schema (checked as every API's schemas
are; one that runs dry mid-stream ends it in an ``error`` event), what cannot be served refused with OpenAI's
400 (images, reasoning, a stored response to continue), names checked as on every route, and
the requests counted in ``/metrics`` and the request log."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from moefixtures import tiny_spec
from moepack.checkpoint.synth import synth_model
from served import Served, logit_bias

pytest.importorskip("llama_cpp.server", reason="moepack[serve] is installed by ./dev test")
openai = pytest.importorskip("openai", reason="the test extra installs the openai client")
pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    spec = tiny_spec(layers=2, experts=16, top_k=2, hidden=128, expert_ffn=64, weight_type="Q8_0")
    return synth_model(tmp_path_factory.mktemp("responses") / "m.gguf", spec).paths[0]


@pytest.fixture(scope="module")
def server(model) -> Iterator[Served]:
    with Served(model, "--ctx", 2048, "--threads", 1, "--log-json") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> Any:
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def greedy(model) -> dict[str, Any]:
    return {"temperature": 0, "extra_body": {"logit_bias": logit_bias(model)}}


def test_plain_and_streamed_give_the_same_answer(client, greedy, server):
    plain = client.responses.create(model="m", input=USER, max_output_tokens=24, **greedy)
    assert plain.object == "response" and plain.model == "m" and plain.id.startswith("resp_")
    assert plain.status in ("completed", "incomplete") and plain.output_text
    assert plain.usage.input_tokens > 0 and 0 < plain.usage.output_tokens <= 24
    assert plain.usage.total_tokens == plain.usage.input_tokens + plain.usage.output_tokens
    kinds, text, final = [], "", None
    with client.responses.stream(model="m", input=USER, max_output_tokens=24, **greedy) as s:
        for event in s:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response  # (the SDK's get_final_response takes completed only)
    assert final is not None
    assert text == plain.output_text == final.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens and final.status == plain.status
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-1] in ("response.completed", "response.incomplete")
    raw = server.post("/v1/responses", json.dumps({"model": "m", "input": "x", "stream": True,
                                                   "max_output_tokens": 4}).encode())[1]  # fmt: skip
    numbers = [json.loads(ln[6:])["sequence_number"] for ln in raw.splitlines()
               if ln.startswith("data: ")]  # fmt: skip
    assert numbers == list(range(len(numbers))) and len(numbers) >= 6


def test_the_budget_instructions_format_and_a_named_call(client, model, server):
    endless = {"temperature": 0, "extra_body": {"logit_bias": logit_bias(model, endless=True)}}
    cut = client.responses.create(model="m", input="x", max_output_tokens=5, **endless)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 5
    alone = client.responses.create(model="m", input=USER, max_output_tokens=1)
    told = client.responses.create(model="m", input=USER, instructions="be terse",
                                   max_output_tokens=1)  # fmt: skip
    assert told.usage.input_tokens > alone.usage.input_tokens and told.instructions == "be terse"
    turns = [*USER, {"role": "assistant", "content": "a fox"}, {"role": "user", "content": "and?"}]
    longer = client.responses.create(model="m", input=turns, max_output_tokens=1)
    assert longer.usage.input_tokens > alone.usage.input_tokens
    js = client.responses.create(model="m", input=USER, max_output_tokens=32,
                                 text={"format": {"type": "json_object"}}, temperature=0)  # fmt: skip
    assert js.output_text.lstrip()[:1] in ("{", "[")
    tool = {"type": "function", "name": "get_weather", "description": "the weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}  # fmt: skip
    called = client.responses.create(model="m", input=USER, tools=[tool], tool_choice="required",
                                     max_output_tokens=64, temperature=0)  # fmt: skip
    calls = [o for o in called.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    if calls[0].status == "completed":
        assert "city" in json.loads(calls[0].arguments)
    # the call and its output back as turns
    back = [*USER, {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                    "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}]  # fmt: skip
    assert client.responses.create(model="m", input=back, max_output_tokens=2).output


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
        "required": ["city"]}  # fmt: skip
DEAD_LATER = {"type": "string", "pattern": "^ab\\x00$"}
"""A schema whose grammar starts (a quote, a, b) and then allows no token of any vocabulary."""


def _events(text: str) -> list[dict[str, Any]]:
    return [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: ")]


def test_a_json_schema_format_is_checked_as_every_api_checks_it(client, server):
    fmt = {"type": "json_schema", "name": "place", "schema": CITY}
    got = client.responses.create(model="m", input=USER, max_output_tokens=64, temperature=0,
                                  text={"format": fmt})  # fmt: skip
    assert got.output_text.startswith("{")
    if got.status == "completed":
        assert set(json.loads(got.output_text)) == {"city"}
    echoed = got.text.format
    assert (echoed.type, echoed.name, echoed.schema_, echoed.strict) == ("json_schema", "place",
                                                                         CITY, False)  # fmt: skip
    for bad_fmt, param, code in (
        ({"type": "json_schema", "schema": CITY}, "text.format.name", "missing_required_parameter"),
        ({"type": "json_schema", "name": "a b", "schema": CITY}, "text.format.name", None),
        ({"type": "json_schema", "name": "x"}, "text.format.schema", None),
        ({"type": "yaml"}, "text.format.type", None),
        ({**fmt, "schema": {"type": "string", "maxLength": 100_000}}, "text.format.schema",
         "invalid_grammar"),
        ({**fmt, "schema": {"enum": []}}, "text.format.schema", "invalid_grammar"),
    ):  # fmt: skip
        for stream in (False, True):
            body = {"model": "m", "input": "x", "text": {"format": bad_fmt}, "stream": stream}
            status, text = server.post("/v1/responses", json.dumps(body).encode())
            error = json.loads(text)["error"]
            assert status == 400 and (error["param"], error["code"]) == (param, code), text
    status, text = server.post("/v1/responses", b'{"model": "m", "input": "x", "text": 5}')
    assert status == 400 and json.loads(text)["error"]["param"] == "text", text
    # a grammar that runs out of tokens later: plain a 400; streamed, its last event an error
    # in both the spec's shape (nested) and the SDK's (at the top)
    dead_format = {"type": "json_schema", "name": "x", "schema": DEAD_LATER}
    dead = {"model": "m", "input": "x", "max_output_tokens": 16, "text": {"format": dead_format}}
    status, text = server.post("/v1/responses", json.dumps(dead).encode())
    assert status == 400 and json.loads(text)["error"]["code"] == "invalid_grammar", text
    status, text = server.post("/v1/responses", json.dumps({**dead, "stream": True}).encode())
    assert status == 200, text  # the first token went out before the grammar ran dry
    events = _events(text)
    last = events[-1]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert last["type"] == "error" and last["code"] == "invalid_grammar", last
    assert last["error"]["code"] == "invalid_grammar" and "no token" in last["message"]
    with (
        pytest.raises(openai.APIError, match="no token"),
        client.responses.stream(
            model="m", input="x", max_output_tokens=16, text={"format": dead_format}
        ) as s,
    ):
        for _ in s:
            pass
    assert client.responses.create(model="m", input=USER, max_output_tokens=2).output


def _refused(call: Any) -> tuple[int, dict[str, Any]]:
    with pytest.raises(openai.APIStatusError) as e:
        call()
    body = e.value.body
    assert isinstance(body, dict) and {"message", "type", "param", "code"} <= set(body), body
    return e.value.status_code, body


def test_what_cannot_be_served_is_refused(client, server):
    image = [{"role": "user", "content": [{"type": "input_text", "text": "what is it?"},
              {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]  # fmt: skip
    for kw, status, words in (
        ({"input": image}, 400, "takes text"),
        ({"input": USER, "reasoning": {"effort": "low"}}, 400, "reason"),
        ({"input": USER, "previous_response_id": "resp_1"}, 400, "stores no responses"),
        ({"input": USER, "tools": [{"type": "web_search"}]}, 400, "function tools"),
        ({"input": USER, "tools": [{"type": "function", "name": "t"}]}, 400,
         "chatml-function-calling"),
        ({"input": USER, "temperature": -1}, 400, "temperature"),
        ({"input": []}, 400, "input"),
    ):  # fmt: skip
        got, body = _refused(lambda kw=kw: client.responses.create(model="m", **kw))
        assert got == status and words in body["message"], body
    got, body = _refused(lambda: client.responses.create(model="gpt-4o", input=USER))
    assert got == 404 and body["code"] == "model_not_found"
    status, text = server.post("/v1/responses", b'{"input": "x"}')
    assert status == 400 and json.loads(text)["error"]["param"] == "model"
    # none of it hurt the server; every request counted and logged
    assert client.responses.create(model="m", input=USER, max_output_tokens=2).output
    assert client.responses.create(model="m", input=USER, max_output_tokens=2,
                                   reasoning={"effort": "none"}).output  # fmt: skip
    for fields in ({"seed": 7.0}, {"seed": -0.0}, {"top_k": 5.0}):  # whole floats: ints to C
        got = client.responses.create(model="m", input=USER, max_output_tokens=2,
                                      extra_body=fields)  # fmt: skip
        assert got.output, fields
    metrics = server.wait_idle()
    assert metrics['moepack_requests_total{code="200",path="/v1/responses"}'] >= 2
    assert metrics['moepack_requests_total{code="400",path="/v1/responses"}'] >= 7
    logged = [json.loads(ln) for ln in server.requests()]
    ours = [r for r in logged if r["route"] == "/v1/responses" and r["status"] == 200]
    assert ours and ours[-1]["api"] == "openai" and ours[-1]["stop_reason"] in ("stop", "length")
