"""``moepack serve`` under the requests an outside fuzz campaign sent, one served synthetic model
for most of them: forced tools whose schemas make grammars llama.cpp refuses or cannot finish,
on every route that makes a grammar, are 4xx in the route's own shape and the worker stays the
same process; a prompt too large for ``/v1/messages`` and ``count_tokens`` is 413 by its bytes;
seeds and ``logit_bias`` are refused alike by both APIs; ``max_tokens`` is never exceeded, a
character's bytes split across tokens or not; a context llama.cpp rounds up serves its whole
length; a ``Content-Length`` that is no number is answered in the API's shape; a forced call's
arguments are JSON a strict parser reads, plain and streamed alike; OpenAI's ``required`` tool
choice on ``chatml-function-calling``; requests waiting when SIGTERM comes are 503 in their
API's shape; a context below llama.cpp's is one line."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from moefixtures import tiny_spec
from moepack.checkpoint.gguf_file import GgufFile
from moepack.checkpoint.synth import synth_model
from served import Served, logit_bias

pytest.importorskip("llama_cpp.server", reason="moepack[serve] is installed by ./dev test")
anthropic = pytest.importorskip("anthropic", reason="the test extra installs the anthropic client")
pytestmark = pytest.mark.slow

CTX = 1000  # llama.cpp makes it 1024
USER = [{"role": "user", "content": "the quick brown fox"}]
COMPLETIONS = ("/v1/completions", "/v1/chat/completions")
OBJECT = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    spec = tiny_spec(layers=2, experts=8, top_k=2, hidden=64, expert_ffn=32, weight_type="Q8_0")
    return synth_model(tmp_path_factory.mktemp("fuzzed") / "m.gguf", spec).paths[0]


@pytest.fixture(scope="module")
def server(model) -> Iterator[Served]:
    with Served(model, "--ctx", CTX, "--threads", 1, "--log-json") as s:
        yield s


@pytest.fixture(scope="module")
def calling(model) -> Iterator[Served]:
    with Served(model, "--ctx", 2048, "--threads", 1, "--chat-format",
                "chatml-function-calling") as s:  # fmt: skip
        yield s


def _request(server: Served, path: str, body: Any, method: str = "POST") -> tuple[int, str]:
    if path in COMPLETIONS and isinstance(body, dict) and "model" not in body:
        body = {"model": "m", **body}  # OpenAI's completion routes require one
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.base + path, data=data, method=method,
                                 headers={"content-type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _openai_error(text: str) -> dict[str, Any]:
    error = json.loads(text)["error"]
    assert set(error) == {"message", "type", "param", "code"}, text
    _no_insides(text)
    return dict(error)


def _anthropic_error(text: str) -> dict[str, Any]:
    body = json.loads(text)
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, text
    _no_insides(text)
    return dict(body["error"])


def _no_insides(text: str) -> None:
    for leak in ("Traceback", "site-packages", ".py", 'File "', "numpy", "broadcast"):
        assert leak not in text, text


def _worker(server: Served) -> int:
    out = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True)
    (pid,) = out.stdout.split()
    return int(pid)


def _alive(server: Served, worker: int) -> None:
    assert _worker(server) == worker
    assert not any("worker died" in line for line in server.stderr), server.stderr


def _forced(schema: Any, **kw: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 8, "messages": USER, "temperature": 0,
            "tools": [{"name": "t", "input_schema": schema}],
            "tool_choice": {"type": "tool", "name": "t"}, **kw}  # fmt: skip


def _openai_tool(schema: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 8, "temperature": 0,
            "tools": [{"type": "function", "function": {"name": "t", "parameters": schema}}],
            "tool_choice": {"type": "function", "function": {"name": "t"}}}  # fmt: skip


# (schema, whether llama.cpp can constrain a call by it once the server made its grammar)
SCHEMAS: list[tuple[Any, bool]] = [
    ({"type": "object", "properties": {'a"b': {"type": "string"}}}, True),  # escaped now
    ({"type": "object", "properties": {"a\nb": {"type": "string"}}}, True),
    ({"enum": ['a"b']}, True),
    ({"const": "\u0000"}, True),  # was a NUL character no token holds: llama.cpp aborted
    ({"anyOf": []}, False),
    ({"enum": []}, False),
    ({"type": "string", "pattern": "^\\$"}, False),
    ({"type": "object", "properties": {"x": {"$ref": "#/properties/x"}}}, False),  # x ::= x
    ({"type": "string", "maxLength": 100_000}, False),  # nested 100,000 deep: a stack overflow
    ({"$ref": "#"}, True),  # llama-cpp-python cannot convert it: its JSON grammar instead
]


def test_every_schema_on_every_route_is_checked_and_the_worker_lives(server):
    worker = _worker(server)
    for schema, works in SCHEMAS:
        answers = []
        for path, body in (
            ("/v1/messages", _forced(schema)),
            ("/v1/messages", _forced(schema, stream=True)),
            ("/v1/messages", {**_forced(schema), "tool_choice": {"type": "any"}}),
            ("/v1/messages/count_tokens", {k: v for k, v in _forced(schema).items()
                                           if k not in ("max_tokens", "temperature")}),
        ):  # fmt: skip
            status, text = _request(server, path, body)
            answers.append(status)
            if status != 200:
                error = _anthropic_error(text)
                assert error["type"] == "invalid_request_error" and "grammar" in error["message"]
        for path, body in (
            ("/v1/chat/completions", _openai_tool(schema)),
            ("/v1/chat/completions", {**_openai_tool(schema), "stream": True}),
            ("/v1/chat/completions", {"messages": USER, "max_tokens": 4,
                                      "response_format": {"type": "json_object",
                                                          "schema": schema}}),
        ):  # fmt: skip
            status, text = _request(server, path, body)
            answers.append(status)
            if status != 200:
                assert _openai_error(text)["code"] == "invalid_grammar", text
        assert answers == [200 if works else 400] * len(answers), (schema, answers)
    _alive(server, worker)
    # a name with a quote is a key with a quote: the call's arguments are JSON
    status, text = _request(server, "/v1/chat/completions",
                            _openai_tool(SCHEMAS[0][0]) | {"max_tokens": 64})  # fmt: skip
    (call,) = json.loads(text)["choices"][0]["message"]["tool_calls"]
    assert set(json.loads(call["function"]["arguments"])) <= {'a"b'}


GRAMMARS = [
    'root ::= "\\x00"',  # a character no token holds: llama.cpp aborted at the first token
    "root ::= <[99999]>",  # a token the vocabulary has not
    "root ::= <[2]>",  # the end of the text as a token the grammar must see
    "root ::= " + "(" * 30_000 + '"a"' + ")" * 30_000,  # llama.cpp's parser overflowed its stack
    'root ::= x\nx ::= x "a"',  # left recursion
    "root ::= [",
]
DEAD_LATER = 'root ::= "ab" "\\x00"'  # parses and starts, then no token can follow


def test_every_raw_grammar_is_checked_before_llama_cpp_samples_and_the_worker_lives(server):
    worker = _worker(server)
    for grammar in GRAMMARS:
        for path, body in (
            ("/v1/completions", {"prompt": "x", "max_tokens": 4, "grammar": grammar}),
            ("/v1/chat/completions", {"messages": USER, "max_tokens": 4, "grammar": grammar}),
        ):
            status, text = _request(server, path, body)
            assert status == 400 and _openai_error(text)["code"] == "invalid_grammar", text
    for stream, bias in ((False, None), (True, None), (False, {"5": -1})):
        body = {"prompt": "x", "max_tokens": 8, "grammar": DEAD_LATER, "stream": stream,
                "logit_bias": bias}  # fmt: skip
        status, text = _request(server, "/v1/completions", body)
        if stream and status == 200:  # its first tokens went out: the stream ends in an error
            events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: {")]
            text = events[-1]
        else:
            assert status == 400, text
        error = _openai_error(text)
        assert error["code"] == "invalid_grammar" and "no token" in error["message"], text
    _alive(server, worker)
    for bias in (None, {"5": -1}):  # llama-cpp-python's logit_bias sampler has no name to ask
        status, text = _request(server, "/v1/completions", {"prompt": "x", "max_tokens": 4,
                                "grammar": 'root ::= "ab"', "logit_bias": bias})  # fmt: skip
        assert status == 200 and json.loads(text)["choices"][0]["text"] == "ab", text


def test_a_prompt_too_large_for_messages_and_count_tokens_is_413_by_its_bytes(server):
    word = "w" * 400_000  # one word: tokenising it takes time that grows as its square
    for path, extra in (("/v1/messages", {"max_tokens": 4}),
                        ("/v1/messages", {"max_tokens": 4, "stream": True}),
                        ("/v1/messages/count_tokens", {})):  # fmt: skip
        body = {"model": "m", "messages": [{"role": "user", "content": word}], **extra}
        status, text = _request(server, path, body)
        assert status == 413, text
        error = _anthropic_error(text)
        assert error["type"] == "request_too_large" and "--max-prompt-tokens" in error["message"]


SEEDS = [1.5, 1e30, -1, 2**32, True, "5"]
BIASES = [{"99999": 1}, {"-1": 1}, {"x": 1}, {"5": 1000}, {"5": "nan"}, [5]]


def test_seeds_and_logit_bias_are_refused_alike_by_both_apis(server):
    def both(**fields: Any) -> list[tuple[int, str]]:
        chat = _request(server, "/v1/chat/completions",
                        {"messages": USER, "max_tokens": 2, **fields})  # fmt: skip
        messages = _request(server, "/v1/messages",
                            {"model": "m", "messages": USER, "max_tokens": 2, **fields})  # fmt: skip
        return [chat, messages]

    for name, values in (("seed", SEEDS), ("logit_bias", BIASES)):
        for value in values:
            (chat, chat_text), (msg, msg_text) = both(**{name: value})
            assert (chat, msg) == (400, 400), (name, value, chat_text, msg_text)
            assert name in _openai_error(chat_text)["param"], chat_text
            assert name in _anthropic_error(msg_text)["message"], msg_text
    # whole floats reach llama.cpp as ints (were 500s)
    accepted: list[dict[str, Any]] = [{"seed": 7}, {"seed": 0}, {"seed": 2**32 - 1},
                                      {"logit_bias": {"5": -100}}, {"seed": 7.0},
                                      {"seed": -0.0}]  # fmt: skip
    for fields in accepted:
        assert [status for status, _ in both(**fields)] == [200, 200], fields


def _leaders(model: Path) -> dict[str, int]:
    """``logit_bias`` that makes every token the first byte of a three-byte character: the
    text never ends a character, which is when llama-cpp-python skipped its budget check."""
    g = GgufFile(model)
    names = g.get("tokenizer.ggml.tokens")
    g.close()
    return {str(names.index("<0xE2>")): 100}


def _request_with_id(server: Served, path: str, body: Any) -> tuple[int, str, str]:
    """``_request``, with the answer's ``request-id`` (its line in the request log)."""
    if path in COMPLETIONS and "model" not in body:
        body = {"model": "m", **body}
    req = urllib.request.Request(server.base + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=600) as r:
        return r.status, r.read().decode(), str(r.headers["request-id"])


def test_max_tokens_is_never_exceeded_on_any_route(server, model):
    bias = _leaders(model)
    asked: dict[str, int] = {}  # request id: max_tokens
    for max_tokens in (1, 2, 5):
        for path, body in (
            ("/v1/completions", {"prompt": "x", "logit_bias": bias}),
            ("/v1/completions", {"prompt": "", "logit_bias": bias}),  # BOS counted, as usage does
            ("/v1/chat/completions", {"messages": USER, "logit_bias": bias}),
            ("/v1/messages", {"model": "m", "messages": USER, "logit_bias": bias}),
        ):
            for stream in (False, True):
                status, text, ident = _request_with_id(
                    server, path, {**body, "max_tokens": max_tokens, "stream": stream}
                )
                assert status == 200, text
                asked[ident] = max_tokens
                if stream:
                    continue
                reply = json.loads(text)
                if "usage" in reply and "completion_tokens" in reply["usage"]:
                    assert reply["usage"]["completion_tokens"] <= max_tokens, text
                    assert reply["choices"][0]["finish_reason"] == "length", text
                else:
                    assert reply["usage"]["output_tokens"] == max_tokens, text
                    assert reply["stop_reason"] == "max_tokens", text
    # each request's own line (a line of an earlier test may still arrive meanwhile)
    lines = server.logged(lambda ls: set(asked) <= {json.loads(ln)["id"] for ln in ls})
    sampled = {r["id"]: r["generated_tokens"] or 0 for r in map(json.loads, lines)}
    assert all(sampled[i] <= m for i, m in asked.items()), (sampled, asked)


def test_no_answer_names_the_model_files_path(server, model):
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                       ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True}),
                       ("/v1/chat/completions", {"messages": USER, "max_tokens": 2})):  # fmt: skip
        status, text = _request(server, path, body)
        assert status == 200 and str(model.parent) not in text, text
        assert '"model": "m"' in text.replace('"model":"m"', '"model": "m"'), text
    # a null model is none: OpenAI requires one (a 400), which names no path either
    body = {"messages": USER, "max_tokens": 2, "model": None}
    status, text = _request(server, "/v1/chat/completions", body)
    assert status == 400 and _openai_error(text)["param"] == "model", text
    assert str(model.parent) not in text


def test_a_context_llama_cpp_rounds_up_serves_its_whole_length(server):
    status, text = _request(server, "/v1/completions",
                            {"prompt": "x" * 1010, "max_tokens": 4})  # fmt: skip
    assert status == 200, text  # llama.cpp's context is 1024 tokens, llama-cpp-python's was 1000
    assert json.loads(text)["usage"]["prompt_tokens"] > CTX


def test_a_context_below_llama_cpps_least_is_one_line(model):
    # a command of its own: a context taken would start a server that runs until stopped
    done = subprocess.run([sys.executable, "-m", "moepack", "serve", str(model), "--port", "0",
                           "--ctx", "8"], capture_output=True, text=True, timeout=300)  # fmt: skip
    code, out, err = done.returncode, done.stdout, done.stderr
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("moepack: error: ") and "--ctx" in lines[0] and "256" in lines[0]


def _raw(server: Served, head: str) -> str:
    host, port = server.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=600) as s:
        s.sendall(head.encode() + b"{}")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data.decode()


def test_a_content_length_that_is_no_number_is_answered_in_the_apis_shape(server):
    for path in ("/v1/chat/completions", "/v1/messages"):
        reply = _raw(server, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                             "\r\nContent-Length: 2x\r\n\r\n")  # fmt: skip
        head, _, body = reply.partition("\r\n\r\n")
        assert head.startswith("HTTP/1.1 400") and "application/json" in head.lower(), reply
        if path == "/v1/messages":
            assert _anthropic_error(body)["type"] == "invalid_request_error"
        else:
            assert _openai_error(body)["type"] == "invalid_request_error"


def test_forced_calls_are_strict_json_plain_and_streamed_alike(server):
    c = anthropic.Anthropic(base_url=server.base, api_key="none", max_retries=0, timeout=600)
    kw = {"model": "m", "max_tokens": 200, "messages": USER,
          "tools": [{"name": "t", "input_schema": OBJECT}],
          "tool_choice": {"type": "tool", "name": "t"}}  # fmt: skip
    for seed in range(7):
        extra = {"temperature": 1.0, "seed": seed}
        plain = c.messages.create(**kw, extra_body=extra)
        with c.messages.stream(**kw, extra_body=extra) as s:
            for _ in s:
                pass
            streamed = s.get_final_message()
        assert streamed.stop_reason == plain.stop_reason, seed
        assert [b.model_dump(exclude={"id"}) for b in streamed.content] == [
            b.model_dump(exclude={"id"}) for b in plain.content
        ], seed
        if plain.stop_reason == "tool_use":
            (call,) = plain.content
            assert call.type == "tool_use" and isinstance(call.input["note"], str)
        raw = _request(server, "/v1/messages", {**kw, **extra, "stream": True})[1]
        parts = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
        args = "".join(p["delta"]["partial_json"] for p in parts
                       if p["type"] == "content_block_delta"
                       and p["delta"]["type"] == "input_json_delta")  # fmt: skip
        if plain.stop_reason == "tool_use":
            assert json.loads(args) == plain.content[0].input  # strict: no raw control characters
        reply = json.loads(_request(server, "/v1/chat/completions",
                                    {**_openai_tool(OBJECT), "max_tokens": 200, **extra})[1])  # fmt: skip
        if reply["usage"]["completion_tokens"] < 200:  # the grammar ended the call
            (call,) = reply["choices"][0]["message"]["tool_calls"]
            assert isinstance(json.loads(call["function"]["arguments"])["note"], str)


def test_required_tool_choice_on_a_format_that_chooses(calling):
    tool = {"type": "function", "function": {"name": "t", "parameters": OBJECT}}
    other = {"type": "function", "function": {"name": "u", "parameters": OBJECT}}
    body = {"messages": USER, "max_tokens": 48, "temperature": 0, "tool_choice": "required"}
    status, text = _request(calling, "/v1/chat/completions", {**body, "tools": [tool]})
    assert status == 200, text
    (call,) = json.loads(text)["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "t"
    for tools in ([tool, other], None):
        status, text = _request(calling, "/v1/chat/completions", {**body, "tools": tools})
        assert status == 400 and _openai_error(text)["param"] == "tool_choice", text
    # every tool the format may choose is checked, not only a named one
    bad = {"type": "function", "function": {"name": "v", "parameters": {"anyOf": []}}}
    status, text = _request(calling, "/v1/chat/completions",
                            {"messages": USER, "max_tokens": 8, "tools": [tool, bad],
                             "tool_choice": "auto"})  # fmt: skip
    assert status == 400 and _openai_error(text)["code"] == "invalid_grammar", text
    status, text = _request(calling, "/v1/messages",
                            {"model": "m", "messages": USER, "max_tokens": 8,
                             "tools": [{"name": "t", "input_schema": OBJECT},
                                       {"name": "v", "input_schema": {"anyOf": []}}]})  # fmt: skip
    assert status == 400 and "grammar" in _anthropic_error(text)["message"], text


def test_requests_waiting_when_sigterm_comes_are_503_in_their_apis_shape(model):
    waiting = {
        "chat": ("/v1/chat/completions", {"messages": USER, "max_tokens": 2}),
        "chat-stream": ("/v1/chat/completions", {"messages": USER, "max_tokens": 2,
                                                 "stream": True}),
        "completion-stream": ("/v1/completions", {"prompt": "a", "max_tokens": 2,
                                                  "stream": True}),
        "messages": ("/v1/messages", {"model": "m", "messages": USER, "max_tokens": 2}),
        "messages-stream": ("/v1/messages", {"model": "m", "messages": USER, "max_tokens": 2,
                                             "stream": True}),
    }  # fmt: skip
    answers: dict[str, tuple[int, str]] = {}
    with Served(model, "--ctx", 2048, "--threads", 1) as s:
        long = {"prompt": "x", "max_tokens": 2000, "logit_bias": logit_bias(model, endless=True)}
        threads = [threading.Thread(target=lambda: _request(s, "/v1/completions", long))]
        threads[0].start()
        while s.metrics()["moepack_requests_in_flight"] < 1:
            time.sleep(0.05)
        for name, (path, body) in waiting.items():
            t = threading.Thread(
                target=lambda n=name, p=path, b=body: answers.__setitem__(n, _request(s, p, b))
            )
            t.start()
            threads.append(t)
        while s.metrics()["moepack_requests_in_flight"] < 1 + len(waiting):
            time.sleep(0.05)
        s.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=600)
        s.proc.wait(timeout=600)
        code, lines = s.stop()
    assert code == 128 + signal.SIGTERM
    for name, (status, text) in answers.items():
        assert status == 503, (name, text)
        if name.startswith("messages"):
            assert "stopping" in _anthropic_error(text)["message"], text
        else:
            assert _openai_error(text)["code"] == "server_stopping", text
    assert f"{len(waiting)} refused while stopping" in lines[-1], lines
