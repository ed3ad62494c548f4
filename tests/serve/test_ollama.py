"""Ollama's API through the official ``ollama`` client against served synthetic models of each
family the serve tests use (qwen3moe, and the delta-net hybrid qwen35moe): every route, chat
and generate streamed and not (the same text), ``format`` as JSON and as a schema, the
timings of the last object, ``context`` continued, a load request, embeddings (normalised,
``dimensions``, the older route's raw vector); on one
server with ``--api-key``, ``--log-json``, ``--max-queue 1``, ``--max-body`` and aliases: every
bad request a 4xx in Ollama's shape with the worker the same process, the key, the queue, the
body cap, the request log and ``/metrics``, glob aliases on every API, a client that leaves
mid-stream, ``GET /`` answered as Ollama answers it (and the dashboard for a browser); tools
on ``chatml-function-calling``."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moefixtures import replying_model, tiny_spec
from moepack.checkpoint.synth import synth_model
from served import Served, logit_bias

pytest.importorskip("llama_cpp.server", reason="moepack[serve] is installed by ./dev test")
ollama = pytest.importorskip("ollama", reason="the test extra installs the ollama client")
openai = pytest.importorskip("openai", reason="the test extra installs the openai client")
anthropic = pytest.importorskip("anthropic", reason="the test extra installs the anthropic client")
pytestmark = pytest.mark.slow

KEY = "sk-test-ollama"
CTX = 2048
FAMILIES = ("qwen3moe", "qwen35moe")
USER = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog"}]
GREEDY = {"temperature": 0, "seed": 7, "num_predict": 24}
TIMINGS = ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration",
           "eval_count", "eval_duration")  # fmt: skip
SHAPE = dict(layers=4, experts=16, top_k=2, hidden=128, expert_ffn=64, heads=4, kv_heads=2,
             head_dim=32, weight_type="Q8_0")  # fmt: skip


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> Iterator[tuple[str, Served]]:
    """A served model of each family (random weights: its greedy bytes are arbitrary)."""
    arch = request.param
    path = synth_model(tmp_path_factory.mktemp(arch) / "m.gguf",
                       tiny_spec(arch=arch, **SHAPE)).paths[0]  # fmt: skip
    # no prefix cache: a restored state is computed in other batch shapes than a fresh prompt,
    # and on a random model a near-tie can then turn (the equality below is the API's)
    with Served(path, "--ctx", CTX, "--threads", 1, "--prefix-cache", 0) as s:
        yield arch, s


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return synth_model(tmp_path_factory.mktemp("ollama") / "m.gguf",
                       tiny_spec(**SHAPE)).paths[0]  # fmt: skip


@pytest.fixture(scope="module")
def server(model) -> Iterator[Served]:
    with Served(model, "--ctx", CTX, "--threads", 1, "--api-key", KEY, "--log-json",
                "--max-queue", 1, "--max-body", "64K", "--alias", "m",
                "--alias", "claude-*") as s:  # fmt: skip
        yield s


def _client(server: Served, key: str | None = KEY) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return ollama.Client(host=server.base, headers=headers, timeout=600)


def _http(server: Served, path: str, body: Any = None, method: str | None = None,
          headers: dict[str, str] | None = None) -> tuple[int, str, Any]:  # fmt: skip
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    sent = {"content-type": "application/json", "authorization": f"Bearer {KEY}",
            **(headers or {})}  # fmt: skip
    req = urllib.request.Request(server.base + path, data=data, method=method, headers=sent)
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers


def _error(text: str) -> str:
    """The message of Ollama's error shape (and nothing of the server's insides)."""
    body = json.loads(text)
    assert set(body) == {"error"} and isinstance(body["error"], str), text
    for leak in ("Traceback", "site-packages", ".py", 'File "'):
        assert leak not in text, text
    return str(body["error"])


def _done(last: Any) -> None:
    assert last.done is True and last.done_reason in ("stop", "length"), last
    for name in TIMINGS:
        assert isinstance(getattr(last, name), int) and getattr(last, name) >= 0, (name, last)
    assert last.total_duration > 0 and last.prompt_eval_count > 0 and last.eval_count > 0


def test_every_route_streamed_and_plain_on_each_family(family):
    arch, server = family
    c = _client(server, None)
    assert [m.model for m in c.list().models] == ["m:latest"]
    shown = c.show("m")
    assert shown.details.family == arch and shown.details.format == "gguf"
    assert shown.capabilities == ["completion"] and shown.modelinfo["general.architecture"] == arch
    assert [(m.model, m.context_length) for m in c.ps().models] == [("m:latest", CTX)]
    status, text, _ = _http(server, "/api/version", method="GET")
    assert status == 200 and json.loads(text)["version"]
    # chat: plain and streamed give the same text, a name tagged :latest too
    plain = c.chat(model="m", messages=USER, options=GREEDY)
    chunks = list(c.chat(model="m:latest", messages=USER, options=GREEDY, stream=True))
    assert plain.message.role == "assistant" and plain.message.content
    assert "".join(ch.message.content for ch in chunks) == plain.message.content
    assert not any(ch.done for ch in chunks[:-1]) and chunks[-1].message.content == ""
    _done(plain)
    _done(chunks[-1])
    assert plain.eval_count <= GREEDY["num_predict"] and plain.done_reason == chunks[-1].done_reason
    assert plain.prompt_eval_count == chunks[-1].prompt_eval_count
    # generate: the same, with the conversation's tokens to continue from
    gen = c.generate(model="m", prompt="the quick brown fox jumps", options=GREEDY)
    # the same history before each: a chat turn, then the prompt computed whole (llama.cpp
    # would otherwise reuse all but its last token, in another batch shape)
    c.chat(model="m", messages=USER, options=GREEDY, stream=True)
    parts = list(
        c.generate(model="m", prompt="the quick brown fox jumps", options=GREEDY, stream=True)
    )
    assert gen.response and "".join(p.response for p in parts) == gen.response
    _done(gen)
    _done(parts[-1])
    assert gen.context and list(parts[-1].context) == list(gen.context)
    assert len(gen.context) == gen.prompt_eval_count + gen.eval_count
    more = c.generate(model="m", prompt="and then", context=gen.context, options=GREEDY)
    assert more.prompt_eval_count > len(gen.context)  # the conversation so far, then the turn
    raw = c.generate(model="m", prompt="the quick brown", raw=True, options=GREEDY)
    assert raw.prompt_eval_count < gen.prompt_eval_count  # no template around it
    # format: JSON, and a schema
    js = c.chat(model="m", messages=USER, format="json", options={**GREEDY, "num_predict": 40})
    assert js.message.content.lstrip()[:1] in ("{", "[")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    obj = c.generate(model="m", prompt="x", format=schema, options={**GREEDY, "num_predict": 40})
    assert obj.response.startswith('{"a"') or obj.response.startswith('{ "a"'), obj.response
    # what Ollama's clients send to load a model, and keep_alive
    load = c.generate(model="m")
    assert load.done and load.done_reason == "load" and load.response == ""
    assert c.chat(model="m", messages=[], keep_alive="5m").done_reason == "load"
    assert c.chat(model="m", messages=USER, keep_alive=0, options=GREEDY).done
    # embeddings: one vector of length 1 a text, the same for the same text, by the model
    texts = ["the quick brown fox", "the quick brown fox", "a lazy dog"]
    emb = c.embed(model="m", input=texts)
    vectors = np.array(emb.embeddings)
    assert vectors.shape == (3, SHAPE["hidden"]) and emb.model == "m"
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0)
    assert np.allclose(vectors[0], vectors[1]) and not np.allclose(vectors[0], vectors[2])
    assert emb.prompt_eval_count > 0 and emb.total_duration > 0
    one = np.array(c.embed(model="m", input=texts[0]).embeddings[0])
    assert np.allclose(one, vectors[0], atol=1e-5)
    cut = np.array(c.embed(model="m", input=texts[0], dimensions=16).embeddings[0])
    assert cut.shape == (16,) and np.allclose(cut, one[:16] / np.linalg.norm(one[:16]), atol=1e-5)
    legacy = np.array(c.embeddings(model="m", prompt=texts[0]).embedding)  # as the model gives it
    assert np.allclose(legacy / np.linalg.norm(legacy), one, atol=1e-5)
    assert list(c.embeddings(model="m", prompt="").embedding) == []
    assert c.embed(model="m", input=[]).embeddings == []
    assert server.proc.poll() is None


def _worker(server: Served) -> int:
    out = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True)
    (pid,) = out.stdout.split()
    return int(pid)


def test_bad_requests_are_4xx_in_ollama_shape_and_the_worker_lives(server):
    worker = _worker(server)
    image = {"role": "user", "content": "what is it?", "images": ["iVBORw0KGgo="]}
    cases: list[tuple[str, Any, int, str]] = [
        ("/api/chat", {"model": "gpt-4o", "messages": USER}, 404, "claude-*"),
        ("/api/chat", {"messages": USER}, 400, "model is required"),
        ("/api/chat", {"model": "m", "messages": [image]}, 400, "images are not supported"),
        ("/api/generate", {"model": "m", "prompt": "x", "images": ["AAAA"]}, 400, "images"),
        ("/api/chat", {"model": "m", "messages": USER, "think": True}, 400, "thinking"),
        ("/api/chat", {"model": "m", "messages": USER, "options": {"num_ctx": 8192}}, 400,
         "--ctx"),
        ("/api/chat", {"model": "m", "messages": USER, "options": {"temperature": "hot"}}, 400,
         "temperature"),
        ("/api/chat", {"model": "m", "messages": USER, "options": {"seed": -5}}, 400, "seed"),
        ("/api/chat", {"model": "m", "messages": USER, "options": {"num_predict": 1.5}}, 400,
         "num_predict"),
        ("/api/chat", {"model": "m", "messages": USER, "format": "yaml"}, 400, "format"),
        ("/api/chat", {"model": "m", "messages": USER, "format": {"anyOf": []}}, 400, "grammar"),
        ("/api/chat", {"model": "m", "messages": USER, "tools": [{"type": "function",
         "function": {"name": "t", "parameters": {"type": "object"}}}]}, 400,
         "chatml-function-calling"),
        ("/api/chat", {"model": "m", "messages": [{"role": "robot", "content": "x"}]}, 400,
         "role"),
        ("/api/generate", {"model": "m", "prompt": "x", "template": "{{ .Prompt }}"}, 400,
         "template"),
        ("/api/generate", {"model": "m", "prompt": "x", "suffix": "y"}, 400, "suffix"),
        ("/api/generate", {"model": "m", "prompt": "x", "context": [1, 999999]}, 400, "context"),
        ("/api/generate", {"model": "m", "prompt": "x", "keep_alive": [1]}, 400, "keep_alive"),
        ("/api/generate", {"model": "m", "prompt": "word " * 500}, 400, "context window"),
        ("/api/show", {"model": "nope"}, 404, "not found"),
        ("/api/embed", {"model": "nope", "input": "x"}, 404, "not found"),
        ("/api/embed", {"model": "m", "input": 5}, 400, "input"),
        ("/api/embed", {"model": "m", "input": ["x", 5]}, 400, "input"),
        ("/api/embed", {"model": "m", "input": "x", "truncate": "no"}, 400, "truncate"),
        ("/api/embed", {"model": "m", "input": "x", "dimensions": 0}, 400, "dimensions"),
        ("/api/embed", {"model": "m", "input": "word " * 500, "truncate": False}, 400,
         "truncate: true"),
        ("/api/embeddings", {"model": "m", "prompt": ["x"]}, 400, "prompt"),
        ("/api/chat", b"{not json", 400, "JSON"),
        ("/api/chat", b"[1]", 400, "object"),
        ("/api/chat", b"x" * (70 << 10), 413, "--max-body"),
        ("/api/pull", {"model": "m"}, 404, "/api/pull"),
    ]  # fmt: skip
    for path, body, status, words in cases:
        got, text, _ = _http(server, path, body)
        assert got == status and words in _error(text), (
            path,
            body if len(str(body)) < 200 else "",
            text,
        )
    got, text, headers = _http(server, "/api/chat", method="GET")
    assert got == 405 and "POST" in headers["allow"] and _error(text)
    got, text, _ = _http(server, "/api/tags", method="GET", headers={"authorization": "Bearer no"})
    assert got == 401 and _error(text) == "invalid API key"
    with pytest.raises(ollama.ResponseError) as e:
        _client(server, None).list()
    assert e.value.status_code == 401
    reply = _client(server).chat(model="m", messages=USER, options={"num_predict": 4})
    assert reply.done
    # a text longer than the context is cut to it (truncate's default)
    got, text, _ = _http(server, "/api/embed", {"model": "m", "input": "word " * 500})
    assert got == 200 and json.loads(text)["prompt_eval_count"] == CTX, text
    # an integer option as a whole float reaches llama.cpp as an int (it was a 500)
    for options in ({"seed": 7.0}, {"seed": -0.0}, {"top_k": 5.0}, {"mirostat": 0.0}):
        got, text, _ = _http(server, "/api/chat", {"model": "m", "messages": USER, "stream": False,
                                                  "options": {"num_predict": 2, **options}})  # fmt: skip
        assert got == 200 and json.loads(text)["done"], (options, text)
    assert _worker(server) == worker and not any("worker died" in ln for ln in server.stderr)


def test_names_are_aliases_and_globs_on_every_api(server):
    c = _client(server)
    assert [m.model for m in c.list().models] == ["m:latest"]  # plain names only
    reply = c.chat(model="claude-sonnet-4-5", messages=USER, options={"num_predict": 4})
    assert reply.model == "claude-sonnet-4-5" and reply.done
    ac = anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0, timeout=600)
    m = ac.messages.create(model="claude-haiku-4-5", max_tokens=4, messages=USER)
    assert m.model == "claude-haiku-4-5"
    assert [x.id for x in ac.models.list()] == ["m"]  # Anthropic's list shape, the plain names
    oa = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=600)
    assert [x.id for x in oa.models.list()] == ["m"]
    with pytest.raises(openai.NotFoundError) as e:
        oa.chat.completions.create(model="gpt-4o", messages=USER, max_tokens=2)
    said = e.value.body["message"]
    assert "`m`" in said and "`claude-*`" in said and "--alias" in said
    with pytest.raises(anthropic.NotFoundError):
        ac.messages.create(model="gpt-4o", max_tokens=2, messages=USER)
    chat = oa.chat.completions.create(model="claude-opus-4", messages=USER, max_tokens=2)
    assert chat.model == "claude-opus-4"


def test_the_log_metrics_and_a_full_queue(server, model):
    c = _client(server)
    before = server.wait_idle().get('moepack_requests_total{code="200",path="/api/chat"}', 0)
    seen = len(server.requests())
    c.chat(model="m", messages=USER, options={"num_predict": 3})
    list(c.generate(model="m", prompt="x", options={"num_predict": 3}, stream=True))
    metrics = server.wait_idle()
    assert metrics['moepack_requests_total{code="200",path="/api/chat"}'] == before + 1
    assert metrics['moepack_requests_total{code="200",path="/api/generate"}'] >= 1
    logged = [json.loads(ln) for ln in server.logged(lambda ls: len(ls) >= seen + 2)[seen:]]
    ours = [r for r in logged if r["api"] == "ollama" and r["route"] == "/api/generate"]
    assert ours and ours[-1]["stream"] is True and ours[-1]["generated_tokens"] >= 1
    assert ours[-1]["stop_reason"] in ("stop", "length") and ours[-1]["prompt_tokens"] > 0
    # one generation running (OpenAI's, endless), one Ollama request waiting: the next is 429
    oa = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=600)
    endless = {"temperature": 0, "logit_bias": logit_bias(model, endless=True)}
    running = oa.chat.completions.create(model="m", messages=USER, max_tokens=1500, stream=True,
                                         extra_body=endless)  # fmt: skip
    next(iter(running))
    waiting: list[Any] = []
    thread = threading.Thread(target=lambda: waiting.append(c.chat(
        model="m", messages=USER, options={"num_predict": 2})), daemon=True)  # fmt: skip
    thread.start()
    deadline = time.monotonic() + 120
    while server.metrics()["moepack_requests_in_flight"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    got, text, headers = _http(server, "/api/generate", {"model": "m", "prompt": "x"})
    assert got == 429 and "--max-queue" in _error(text) and headers["retry-after"] == "1"
    running.close()
    thread.join(timeout=600)
    assert waiting and waiting[0].done


def test_a_client_that_leaves_mid_stream_stops_its_generation(server):
    c = _client(server)
    before = server.wait_idle()['moepack_tokens_total{phase="decode"}']
    # a string of at least 1,400 characters: the grammar allows no end before
    endless = {"type": "string", "minLength": 1400}
    stream = c.generate(model="m", prompt="x", format=endless, stream=True,
                        options={"num_predict": 1500, "temperature": 0})  # fmt: skip
    for n, _ in enumerate(stream):
        if n == 3:
            break
    stream.close()
    decoded = server.wait_idle()['moepack_tokens_total{phase="decode"}'] - before
    assert 0 < decoded < 750
    assert c.chat(model="m", messages=USER, options={"num_predict": 2}).done


def test_root_answers_as_ollama_and_the_dashboard_stays_for_browsers(server):
    got, text, headers = _http(server, "/", method="GET", headers={"authorization": ""})
    assert got == 200 and text == "Ollama is running"
    assert headers["content-type"].startswith("text/plain")
    got, text, _ = _http(server, "/", method="HEAD", headers={"authorization": ""})
    assert got == 200 and text == ""
    got, text, headers = _http(server, "/", method="GET",
                               headers={"accept": "text/html,application/xhtml+xml"})  # fmt: skip
    assert got == 200 and headers["content-type"].startswith("text/html") and "<html" in text


@pytest.fixture(scope="module")
def calling(tmp_path_factory) -> Iterator[Served]:
    path = replying_model(tmp_path_factory.mktemp("calling") / "r.gguf")
    with Served(path, "--ctx", CTX, "--threads", 1, "--chat-format",
                "chatml-function-calling") as s:  # fmt: skip
        yield s


def test_tools_where_the_chat_format_chooses(calling):
    c = _client(calling, None)
    tool = {"type": "function", "function": {"name": "get_weather", "description": "the weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}  # fmt: skip
    assert "tools" in (c.show("r").capabilities or [])
    for stream in (False, True):
        if stream:
            parts = list(c.chat(model="r", messages=USER, tools=[tool], stream=True,
                                options={"num_predict": 64}))  # fmt: skip
            last = parts[-1]
            calls = [tc for p in parts for tc in (p.message.tool_calls or [])]
            text = "".join(p.message.content or "" for p in parts)
        else:
            last = c.chat(model="r", messages=USER, tools=[tool], options={"num_predict": 64})
            calls, text = list(last.message.tool_calls or []), last.message.content or ""
        assert last.done and last.eval_count > 0
        assert calls or text  # the format chose a call or a message
        for call in calls:
            assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
    # a call's result goes back as a tool message
    turns = [*USER, {"role": "assistant", "content": "", "tool_calls": [{"function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]  # fmt: skip
    assert c.chat(model="r", messages=turns, tools=[tool], options={"num_predict": 16}).done
