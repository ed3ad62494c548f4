"""``moepack serve`` through the official ``openai`` client: chat and text completions, streamed
and not, the models list, the same text with and without ``--prefetch``, bad requests in the
OpenAI error shape, queueing, a client leaving mid-stream, ``/metrics`` and ``/v1/models``
while a generation runs."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from moefixtures import tiny_spec
from moepack.checkpoint.synth import synth_model
from served import Served, logit_bias

pytest.importorskip("llama_cpp.server", reason="moepack[serve] is installed by ./dev test")
openai = pytest.importorskip("openai", reason="the test extra installs the openai client")
pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog"}]
PROMPT = "the quick brown fox"
ALIAS = "m"
CTX = 4096
LONG = 2000  # tokens a long generation asks for (the end-of-sequence token banned)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    spec = tiny_spec(layers=4, experts=32, top_k=4, hidden=256, expert_ffn=256, weight_type="Q8_0")
    return synth_model(tmp_path_factory.mktemp("serve") / f"{ALIAS}.gguf", spec).paths[0]


@pytest.fixture(scope="module")
def plain(model) -> Iterator[Served]:
    with Served(model, "--ctx", CTX, "--threads", 1) as s:
        yield s


@pytest.fixture(scope="module")
def prefetched(model) -> Iterator[Served]:
    with Served(model, "--ctx", CTX, "--threads", 1, "--prefetch") as s:
        yield s


def _texts(server: Served, model: Path) -> dict[str, str]:
    """A chat completion and a text completion at temperature 0, each plain and streamed."""
    c = server.client()
    kw = {"model": ALIAS, "max_tokens": 24, "temperature": 0, "logit_bias": logit_bias(model)}
    chat = c.chat.completions.create(messages=CHAT, **kw)
    assert chat.choices[0].finish_reason in ("length", "stop")
    assert chat.usage.completion_tokens > 0 and chat.usage.prompt_tokens > 0
    pieces = []
    for chunk in c.chat.completions.create(messages=CHAT, stream=True, **kw):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    text = c.completions.create(prompt=PROMPT, **kw)
    streamed = [
        chunk.choices[0].text for chunk in c.completions.create(prompt=PROMPT, stream=True, **kw)
    ]
    return {
        "chat": chat.choices[0].message.content or "",
        "chat streamed": "".join(pieces),
        "text": text.choices[0].text,
        "text streamed": "".join(streamed),
    }


def test_the_openai_client_talks_to_the_server(plain, model):
    c = plain.client()
    assert [m.id for m in c.models.list()] == [ALIAS]
    got = _texts(plain, model)
    assert got["chat"] and got["text"]
    # chunks reassemble to the text of the plain request (greedy: the same tokens)
    assert got["chat streamed"] == got["chat"]
    assert got["text streamed"] == got["text"]
    m = plain.metrics()
    assert m["moepack_prefetch_enabled"] == 0
    assert m['moepack_tokens_total{phase="prefill"}'] > 0
    assert m['moepack_tokens_total{phase="decode"}'] > 0
    assert m['moepack_tokens_per_second{phase="decode",window="all"}'] > 0
    assert 0 < m["moepack_expert_bytes_resident"] <= m["moepack_expert_bytes"]
    assert m['moepack_requests_total{code="200",path="/v1/chat/completions"}'] >= 2


def test_prefetch_gives_the_same_text(plain, prefetched, model):
    assert _texts(prefetched, model) == _texts(plain, model)
    m = prefetched.metrics()
    assert m["moepack_prefetch_enabled"] == 1
    # the prefetcher saw every pass; the model is cached here (llama.cpp read it all while
    # loading), so it let them run without the callback and read nothing
    assert m["moepack_prefetch_passes_total"] > 0
    assert m["moepack_prefetch_passes_total"] >= m["moepack_prefetch_passes_cached_total"]
    assert m["moepack_prefetch_seconds_total"] >= 0 and m["moepack_prefetch_bytes_total"] >= 0
    assert plain.metrics()["moepack_prefetch_passes_total"] == 0


def _error(call) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as e:
        call()
    body = e.value.body
    assert isinstance(body, dict) and {"message", "type", "param", "code"} <= set(body), body
    return e.value.status_code, body


def test_bad_requests_get_the_openai_error_shape_and_the_server_lives_on(plain):
    c = plain.client()
    status, err = _error(
        lambda: c.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=4)
    )
    assert status == 404 and err["code"] == "model_not_found" and "gpt-4o" in err["message"]
    long = "word " * (CTX // 4)  # 7 tokens a word in this byte vocabulary, 5 bytes
    for stream in (False, True):  # a prompt longer than the context, plain and streamed
        status, err = _error(
            lambda stream=stream: c.completions.create(
                model=ALIAS, prompt=long, max_tokens=4, stream=stream
            )
        )
        assert status == 400 and err["code"] == "context_length_exceeded", err
        status, err = _error(
            lambda stream=stream: c.chat.completions.create(
                model=ALIAS,
                messages=[{"role": "user", "content": long}],
                max_tokens=4,
                stream=stream,
            )
        )
        assert status == 400 and err["code"] == "context_length_exceeded", err
    for create, kw in (
        (c.chat.completions.create, {"messages": CHAT}),
        (c.completions.create, {"prompt": PROMPT}),
    ):
        status, err = _error(lambda create=create, kw=kw: create(model=ALIAS, max_tokens=-1, **kw))
        assert status == 400 and err["param"] == "max_tokens", err
    status, err = _error(
        lambda: c.chat.completions.create(model=ALIAS, messages=CHAT, temperature="hot")
    )
    assert status == 400 and err["param"] == "temperature"
    status, err = _error(  # an untraced server keeps the last token's logits only
        lambda: c.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=2, logprobs=2)
    )
    assert status == 400 and err["param"] == "logprobs"
    for raw in (b"{not json", b"[1, 2]", b""):
        status, text = plain.post("/v1/chat/completions", raw)
        body = json.loads(text)
        assert status == 400 and body["error"]["type"] == "invalid_request_error", text
    # none of it hurt the server
    reply = c.chat.completions.create(model=ALIAS, messages=CHAT, max_tokens=4, temperature=0)
    assert reply.choices[0].message.content


def test_requests_queue_on_the_one_model(plain):
    c = plain.client()
    alone = c.chat.completions.create(model=ALIAS, messages=CHAT, max_tokens=16, temperature=0)
    got: dict[int, str] = {}

    def ask(i: int) -> None:
        r = c.chat.completions.create(model=ALIAS, messages=CHAT, max_tokens=16, temperature=0)
        got[i] = r.choices[0].message.content or ""

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert got == {i: alone.choices[0].message.content for i in range(3)}


def test_metrics_and_models_answer_while_a_generation_runs(plain, model):
    c = plain.client()
    stream = c.chat.completions.create(
        model=ALIAS, messages=CHAT, max_tokens=LONG, temperature=0, stream=True,
        logit_bias=logit_bias(model, endless=True),
    )  # fmt: skip
    chunks = iter(stream)
    next(chunks)
    # the stream is open and unread: its generation runs (or waits for the reader)
    assert plain.metrics()["moepack_requests_in_flight"] >= 1
    assert [m.id for m in c.models.list()] == [ALIAS]
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "length"  # it ran to the end it asked for
    assert plain.wait_idle()["moepack_requests_in_flight"] == 0


def test_a_client_that_leaves_mid_stream_stops_its_generation(plain, model):
    c = plain.client()
    before = plain.wait_idle()['moepack_tokens_total{phase="decode"}']
    stream = c.chat.completions.create(
        model=ALIAS, messages=CHAT, max_tokens=LONG, temperature=0, stream=True,
        logit_bias=logit_bias(model, endless=True),
    )  # fmt: skip
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    stream.close()
    after = plain.wait_idle()
    decoded = after['moepack_tokens_total{phase="decode"}'] - before
    assert 0 < decoded < LONG // 2  # stopped long before the end it asked for
    # the model is free again
    reply = c.chat.completions.create(model=ALIAS, messages=CHAT, max_tokens=4, temperature=0)
    assert reply.choices[0].message.content
