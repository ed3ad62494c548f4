"""``moepack serve`` under the requests of a fuzz and fault campaign (issue 25), one served
synthetic model for the module: every bad request is a 4xx in the OpenAI shape with no
traceback text and the server lives on; a 50 MB body is 413 at once while ``/metrics``
answers; streamed text is the plain text, high bytes included; a worker killed under it is
started again on the same port with its trace kept; SIGTERM during a long generation ends
the server within its stop, the request answered cut short, one waiting refused 503, the
trace written, and the last line says what the server did."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from moefixtures import tiny_spec
from moepack.checkpoint.synth import synth_model
from moepack.trace import load_trace
from served import Served, logit_bias

pytest.importorskip("llama_cpp.server", reason="moepack[serve] is installed by ./dev test")
pytest.importorskip("openai", reason="the test extra installs the openai client")
pytestmark = pytest.mark.slow

CTX = 2048
CHAT = [{"role": "user", "content": "the quick brown fox"}]
JSON = "application/json"
FORM = "application/x-www-form-urlencoded"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    spec = tiny_spec(layers=2, experts=8, top_k=2, hidden=64, expert_ffn=32, weight_type="Q8_0")
    return synth_model(tmp_path_factory.mktemp("harden") / "m.gguf", spec).paths[0]


@pytest.fixture(scope="module")
def trace_out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("harden-trace") / "served.moetrace"


@pytest.fixture(scope="module")
def server(model, trace_out) -> Iterator[Served]:
    with Served(model, "--ctx", CTX, "--threads", 1, "--trace-out", trace_out) as s:
        yield s


def _post(server: Served, path: str, body: bytes, kind: str | None = JSON) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    headers = {"content-type": kind} if kind else {}
    req = urllib.request.Request(server.base + path, data=body, headers=headers)
    if kind is None:
        req.remove_header("Content-type")  # urllib adds a form type to any body
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _completion(**fields: object) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2, **fields}).encode()


def _chat(**fields: object) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 2, **fields}).encode()  # fmt: skip


BAD = [
    # (path, body, content type, status, code or param)
    ("/v1/completions", _completion(grammar="x"), JSON, 400, "invalid_grammar"),
    (
        "/v1/completions",
        b'{"model":"m","prompt":"hi","max_tokens":2,"grammar":1e308}',
        JSON,
        400,
        "grammar",
    ),
    (
        "/v1/chat/completions",
        json.dumps({"model": "m", "messages": CHAT, "grammar": "root ::= x"}).encode(),
        JSON,
        400,
        "invalid_grammar",
    ),  # fmt: skip
    ("/extras/detokenize", b'{"tokens":[999999999]}', JSON, 400, "invalid_token_id"),
    ("/extras/detokenize", b'{"tokens":[-1]}', JSON, 400, "invalid_token_id"),
    ("/v1/completions", _completion(logit_bias={"x": 1}), JSON, 400, "logit_bias"),
    ("/v1/completions", _completion(logit_bias={"99999": 1}), JSON, 400, "invalid_token_id"),
    ("/v1/completions", b'{"prompt":"\\ud800","max_tokens":2}', JSON, 400, None),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, JSON, 400, None),
    ("/v1/completions", _completion(), "text/plain", 415, "unsupported_media_type"),
    ("/v1/completions", b"prompt=hi", FORM, 415, "unsupported_media_type"),
    ("/v1/completions", _completion(), None, 415, "unsupported_media_type"),
    ("/extras/tokenize", b'{"input": 5}', JSON, 400, "input"),
    ("/v1/completions", _completion(seed=-1), JSON, 400, "seed"),
    ("/v1/completions", _completion(n=3), JSON, 400, "n"),
    ("/v1/completions", _completion(prompt=["a", "b"]), JSON, 400, "prompt"),
    ("/v1/completions", b'{"prompt":"hi","temperature":NaN}', JSON, 400, None),
    ("/v1/embeddings", b'{"input": "hi"}', JSON, 404, "not_found"),
    ("/v1/completions", b'{"prompt":"hi","max_tokens":2}', JSON, 400, "model"),  # required
    (
        "/v1/chat/completions",
        json.dumps(
            {
                "model": "m",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:image/png;base64,AAAA"},
                            },
                        ],
                    }
                ],
            }
        ).encode(),
        JSON,
        400,
        "unsupported_content_type",
    ),  # fmt: skip  (the model takes text: not dropped without a word)
    ("/v1/chat/completions", _chat(reasoning_effort="low"), JSON, 400, "unsupported_parameter"),
    ("/v1/chat/completions", _chat(reasoning={"summary": "auto"}), JSON, 400, "reasoning"),
]


def _no_insides(text: str) -> None:
    for leak in ("Traceback", "site-packages", ".py", 'File "'):
        assert leak not in text, text


def test_bad_requests_are_4xx_in_openai_shape_and_the_server_lives_on(server):
    for path, body, kind, status, which in BAD:
        got, text = _post(server, path, body, kind)
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"}, text
        assert got == status and which in (None, error["code"], error["param"]), (path, text)
        _no_insides(text)
    for method_path, status in (("/nowhere", 404), ("/v1/completions", 405)):
        got, text = server.get(method_path)
        assert got == status and "detail" not in json.loads(text), text
    # fields given as null take their defaults: these run
    got, text = _post(server, "/v1/completions",
                      _completion(presence_penalty=None, frequency_penalty=None, seed=None))  # fmt: skip
    assert got == 200 and json.loads(text)["choices"][0]["finish_reason"], text
    got, text = _post(server, "/v1/chat/completions", _chat(reasoning_effort="none"))
    assert got == 200, text  # no reasoning asked for
    got, text = _post(server, "/extras/detokenize", b'{"tokens":[1,2,200]}')
    assert got == 200 and "text" in json.loads(text)
    c = server.client()
    reply = c.completions.create(model="m", prompt="hi", max_tokens=3, temperature=0)
    assert reply.choices[0].text is not None


def _http_reply(s: socket.socket) -> str:
    """One HTTP/1.1 answer whole: its head, then as many body bytes as it says (a body can
    come in a packet after the head's)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            return data.decode()
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.decode().split("\r\n")[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return (head + b"\r\n\r\n" + body).decode()


def test_a_50_mb_body_is_413_at_once_while_metrics_answer(server):
    host, port = server.base.removeprefix("http://").split(":")
    big = 50 << 20
    answers: list[int] = []

    def scrape() -> None:
        for _ in range(5):
            answers.append(server.get("/metrics")[0])

    with socket.create_connection((host, int(port)), timeout=600) as s:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: {JSON}\r\n"
            f"Content-Length: {big}\r\n\r\n"
        )
        s.sendall(head.encode() + b'{"prompt": "' + b"a" * (1 << 20))  # the rest never sent
        watcher = threading.Thread(target=scrape)
        watcher.start()
        reply = _http_reply(s)
        watcher.join(timeout=600)
    assert reply.startswith("HTTP/1.1 413"), reply
    assert "request_too_large" in reply and "52,428,800 bytes" in reply
    assert answers == [200] * 5
    # a prompt whose bytes alone show it longer than the context: 413 before tokenising
    got, text = _post(server, "/v1/completions", _completion(prompt="word " * 100_000))
    assert got == 413 and json.loads(text)["error"]["code"] == "prompt_too_large", text


def test_streamed_text_is_the_plain_text_with_high_bytes_too(server, model):
    c = server.client()
    eos = logit_bias(model, endless=True, ascii=False)  # any byte, until max_tokens
    for prompt in ("the quick brown fox", "ünïcödé ↯ text", "12 34"):
        kw = {"model": "m", "max_tokens": 48, "temperature": 0, "logit_bias": eos}
        plain = c.completions.create(prompt=prompt, **kw).choices[0].text
        streamed = "".join(
            ch.choices[0].text for ch in c.completions.create(prompt=prompt, stream=True, **kw)
        )
        assert streamed == plain and plain
        msgs = [{"role": "user", "content": prompt}]
        chat = c.chat.completions.create(messages=msgs, **kw).choices[0].message.content
        pieces = [
            ch.choices[0].delta.content or ""
            for ch in c.chat.completions.create(messages=msgs, stream=True, **kw)
            if ch.choices
        ]
        assert "".join(pieces) == chat
    kw = {"model": "m", "prompt": "x", "max_tokens": 48, "temperature": 0, "logit_bias": eos}
    cut = c.completions.create(stop=[plain[10:12]], **kw)
    streamed = "".join(
        ch.choices[0].text for ch in c.completions.create(stop=[plain[10:12]], stream=True, **kw)
    )
    assert streamed == cut.choices[0].text


def _worker(server: Served) -> int:
    out = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True)
    (pid,) = out.stdout.split()
    return int(pid)


def test_a_killed_worker_is_started_again_on_the_same_port(server):
    c = server.client()
    before = c.completions.create(model="m", prompt="before", max_tokens=4, temperature=0)
    worker = _worker(server)
    os.kill(worker, signal.SIGKILL)
    # the port stays bound: a new connection waits in the backlog for the new worker (the
    # client's kept-alive one died with the worker)
    after = server.client().completions.create(
        model="m", prompt="before", max_tokens=4, temperature=0
    )
    assert after.choices[0].text == before.choices[0].text
    assert _worker(server) != worker
    assert any("worker died" in line and "started it again" in line for line in server.stderr)


def test_sigterm_during_a_long_generation_stops_within_seconds_trace_written(
    server, model, trace_out
):
    c = server.client()
    stream = c.completions.create(model="m", prompt="long", max_tokens=CTX - 16,
                                  temperature=0, stream=True,
                                  logit_bias=logit_bias(model, endless=True))  # fmt: skip
    chunks = iter(stream)
    next(chunks)
    waiting: list[tuple[int, str]] = []
    queued = threading.Thread(
        target=lambda: waiting.append(_post(server, "/v1/completions", _completion()))
    )
    queued.start()
    while server.metrics()["moepack_requests_in_flight"] < 2:  # it waits for the model
        time.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    rest = list(chunks)
    queued.join(timeout=600)
    server.proc.wait(timeout=600)  # it ends of itself (stop() would signal it a second time)
    code, lines = server.stop()
    assert rest[-1].choices[0].finish_reason == "length"
    assert 1 + len(rest) < CTX // 2  # cut long before its end
    assert waiting and waiting[0][0] == 503, waiting
    assert json.loads(waiting[0][1])["error"]["code"] == "server_stopping"
    assert code == 128 + signal.SIGTERM
    last = lines[-1]
    assert last.startswith("moepack: stopped; the server answered "), lines
    assert "(1 cut short by the stop, 1 refused while stopping)" in last
    assert last.endswith(f"; wrote {trace_out} (complete)")
    trace = load_trace(trace_out)
    # every completion that ran is a segment, across both workers and the cut one included
    assert len(trace.prompt_segments) >= 10
