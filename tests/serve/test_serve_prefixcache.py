"""The prefix cache as an agent meets it, through the official clients against ``moepack
serve``: turn 1 with a long system prompt, a side request with another system prompt (a
title), turn 2 (turn 1's messages and a few hundred tokens more). The request log must show
turn 2 reusing turn 1's prompt, and turn 2 computing no more tokens than the same turn 2 with
no side request — the time to its first token follows from those counts, which a busy machine
does not change (``benchmarks/bench_serve.py agent`` measures the time). Every completion
route, streamed and not; the greedy text equal to a server with ``--prefix-cache 0``, which
shows the problem: there turn 2 is computed from its start. ``/metrics`` totals what the log
lines say."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
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

CTX = 4096
RULES = " ".join(f"rule {i}: the tool t{i} reads the files of folder f{i}." for i in range(18))
TITLE = "You write a title of five words for the conversation you are given."
ASK = "list the rules about the folders f3 and f7"
MORE = "now the rules about the folder f11, in the order they were given, one a line. " * 4
LOG_SECONDS = 300


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    spec = tiny_spec(layers=4, experts=32, top_k=4, hidden=256, expert_ffn=256, weight_type="Q8_0")
    return synth_model(tmp_path_factory.mktemp("prefix") / "m.gguf", spec).paths[0]


@pytest.fixture(scope="module")
def cached(model) -> Iterator[Served]:
    with Served(model, "--ctx", CTX, "--threads", 1, "--log-json") as s:
        yield s


@pytest.fixture(scope="module")
def uncached(model) -> Iterator[Served]:
    with Served(model, "--ctx", CTX, "--threads", 1, "--log-json", "--prefix-cache", 0) as s:
        yield s


def _logged(server: Served, before: int) -> dict[str, Any]:
    """The request log's line of the request just answered (the one after ``before`` lines)."""
    deadline = time.monotonic() + LOG_SECONDS
    while len(server.requests()) <= before:
        assert time.monotonic() < deadline, "the request was not logged"
        time.sleep(0.05)
    return dict(json.loads(server.requests()[before]))


Turn = Callable[[Served, dict[str, int], str, list[dict[str, str]], int], str]
"""One request at temperature 0: (server, logit bias, system prompt, messages, max tokens) ->
the text answered."""


def _anthropic(stream: bool) -> Turn:
    def turn(
        server: Served, bias: dict[str, int], system: str, messages: list[dict[str, str]], n: int
    ) -> str:
        client = anthropic.Anthropic(base_url=server.base, api_key="none", max_retries=0,
                                     timeout=600)  # fmt: skip
        kw: dict[str, Any] = {"model": "m", "max_tokens": n, "system": system,
                              "messages": messages,
                              "extra_body": {"temperature": 0, "logit_bias": bias}}  # fmt: skip
        if stream:
            with client.messages.stream(**kw) as s:
                m = s.get_final_message()
        else:
            m = client.messages.create(**kw)
        return "".join(b.text for b in m.content if b.type == "text")

    return turn


def _chat(stream: bool) -> Turn:
    def turn(
        server: Served, bias: dict[str, int], system: str, messages: list[dict[str, str]], n: int
    ) -> str:
        kw: dict[str, Any] = {"model": "m", "max_tokens": n, "temperature": 0,
                              "logit_bias": bias,
                              "messages": [{"role": "system", "content": system}, *messages]}  # fmt: skip
        client = server.client()
        if not stream:
            return str(client.chat.completions.create(**kw).choices[0].message.content)
        chunks = client.chat.completions.create(stream=True, **kw)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    return turn


def _completion(stream: bool) -> Turn:
    """The conversation as one text, as a completion client sends it."""

    def turn(
        server: Served, bias: dict[str, int], system: str, messages: list[dict[str, str]], n: int
    ) -> str:
        prompt = system + "".join(f"\n{m['role']}: {m['content']}" for m in messages) + "\n"
        kw: dict[str, Any] = {"model": "m", "max_tokens": n, "temperature": 0, "prompt": prompt,
                              "logit_bias": bias}  # fmt: skip
        client = server.client()
        if not stream:
            return str(client.completions.create(**kw).choices[0].text)
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))

    return turn


@pytest.fixture(scope="module")
def bias(model) -> dict[str, int]:
    """ASCII text (``served.logit_bias``)."""
    return logit_bias(model)


def _agent(
    server: Served, turn: Turn, bias: dict[str, int], session: str, side: bool = True
) -> dict[str, Any]:
    """Turn 1, a side request (with ``side``) and turn 2; each answer and log line."""
    system = f"{session}. {RULES}"
    before = len(server.requests())
    a1 = turn(server, bias, system, [{"role": "user", "content": ASK}], 16)
    r1 = _logged(server, before)
    title = None
    if side:
        title = turn(server, bias, TITLE, [{"role": "user", "content": ASK}], 6)
        _logged(server, before + 1)
    messages = [{"role": "user", "content": ASK}, {"role": "assistant", "content": a1},
                {"role": "user", "content": MORE}]  # fmt: skip
    a2 = turn(server, bias, system, messages, 16)
    r2 = _logged(server, before + 1 + side)
    return {"texts": (a1, title, a2), "r1": r1, "r2": r2}


def test_turn_two_reuses_turn_one_after_a_side_request(cached, uncached, bias):
    got = _agent(cached, _anthropic(False), bias, "Session one")
    off = _agent(uncached, _anthropic(False), bias, "Session one")
    assert got["texts"] == off["texts"]  # the cache never changes the text
    prompt1 = got["r1"]["prompt_tokens"]
    assert prompt1 > 700 and got["r2"]["prompt_tokens"] > prompt1 + 200
    # without the cache, the side request threw turn 1's prompt away
    assert off["r2"]["reused_tokens"] < 64
    # with it, turn 2 reused (almost) all of turn 1's prompt ...
    assert got["r2"]["reused_tokens"] >= prompt1 - 1
    # ... and computed no more than the same turn 2 with no side request
    alone = _agent(uncached, _anthropic(False), bias, "Session one", side=False)
    assert alone["texts"][2] == got["texts"][2]
    computed = {k: r["r2"]["prompt_tokens"] - r["r2"]["reused_tokens"]
                for k, r in (("side", got), ("alone", alone))}  # fmt: skip
    assert computed["side"] <= computed["alone"]


@pytest.mark.parametrize(
    "turn",
    [_anthropic(True), _chat(False), _chat(True), _completion(False), _completion(True)],
    ids=["messages-streamed", "chat", "chat-streamed", "completions", "completions-streamed"],
)
def test_every_completion_route_keeps_the_prefix(cached, uncached, bias, turn, request):
    session = f"Session {request.node.callspec.id}"
    got = _agent(cached, turn, bias, session)
    off = _agent(uncached, turn, bias, session)
    assert got["texts"] == off["texts"]
    assert got["r2"]["reused_tokens"] >= got["r1"]["prompt_tokens"] - 1
    assert off["r2"]["reused_tokens"] < 64


def test_metrics_total_the_logs_reused_tokens(cached, bias):
    _agent(cached, _chat(False), bias, "Session metrics")
    metrics = cached.wait_idle()
    lines = [json.loads(line) for line in cached.requests()]
    logged = [r for r in lines if r["prompt_tokens"] is not None]
    assert metrics["moepack_prompt_tokens_total"] == sum(r["prompt_tokens"] for r in logged)
    reused = sum(r["reused_tokens"] for r in logged)
    assert metrics["moepack_prompt_tokens_reused_total"] == reused > 0
    assert metrics['moepack_prefix_cache_ops_total{op="restored"}'] >= 1
    assert 0 < metrics["moepack_prefix_cache_restored_tokens_total"] <= reused
    assert 0 < metrics["moepack_prefix_cache_bytes"] <= metrics["moepack_prefix_cache_budget_bytes"]
    assert metrics["moepack_prefix_cache_budget_bytes"] == 2 << 30
    assert metrics['moepack_prefix_cache_ops_total{op="failed"}'] == 0
