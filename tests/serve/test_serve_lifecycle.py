"""``moepack serve`` from start to stop: SIGTERM cuts the generation in flight at its next
token, answers it, and exits 143 with one line saying what the server did; ``--trace-out`` writes a trace of the requests (one prompt segment each)
that ``plan`` (then ``repack`` and ``check-dropin``) and ``analyse`` take like one from
``trace capture``; its cap and its text; a port in use and a model llama.cpp aborts on are
one line each."""

from __future__ import annotations

import json
import signal
import socket
from pathlib import Path

import numpy as np
import pytest

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint.synth import synth_model
from moepack.trace import load_trace
from served import Served, logit_bias

pytest.importorskip("llama_cpp.server", reason="moepack[serve] is installed by ./dev test")
pytest.importorskip("openai", reason="the test extra installs the openai client")
pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog"}]
SECRET = "a prompt nobody else wrote"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    spec = tiny_spec(layers=4, experts=32, top_k=4, hidden=256, expert_ffn=256, weight_type="Q8_0")
    return synth_model(tmp_path_factory.mktemp("serve") / "m.gguf", spec).paths[0]


def test_sigterm_cuts_the_generation_in_flight_answers_it_and_exits_143_saying_so(model):
    with Served(model, "--ctx", 2048, "--threads", 1) as server:
        c = server.client()
        stream = c.chat.completions.create(
            model="m", messages=CHAT, max_tokens=600, temperature=0, stream=True,
            logit_bias=logit_bias(model, endless=True),
        )  # fmt: skip
        chunks = iter(stream)
        first = next(chunks)
        server.proc.send_signal(signal.SIGTERM)
        rest = list(chunks)  # the generation ends at its next token, answered whole
        server.proc.wait(timeout=300)  # of itself: stop() would signal it a second time
        code, lines = server.stop()
    assert first.choices and rest
    assert rest[-1].choices[0].finish_reason == "length" and len(rest) < 300
    text = "".join(ch.choices[0].delta.content or "" for ch in [first, *rest] if ch.choices)
    assert text
    assert code == 128 + signal.SIGTERM
    assert lines == ["moepack: stopped; the server answered 1 request (1 cut short by the stop)"]


def test_a_trace_of_the_requests_feeds_plan_repack_check_dropin_and_analyse(
    model, tmp_path, capsys
):
    out = tmp_path / "served.moetrace"
    prompts = [f"{SECRET} {i}: the quick brown fox" for i in range(4)]
    with Served(model, "--prefetch", "--trace-out", out, "--threads", 1) as server:
        c = server.client()
        for i, p in enumerate(prompts):
            if i % 2:  # a traced server keeps every token's logits: logprobs are there
                r = c.completions.create(model="m", prompt=p, max_tokens=12, temperature=0,
                                         logprobs=1)  # fmt: skip
                assert r.choices[0].logprobs is not None
            else:
                msgs = [{"role": "user", "content": p}]
                c.chat.completions.create(model="m", messages=msgs, max_tokens=12, temperature=0)
        served = server.wait_idle()
        code, lines = server.stop(signal.SIGINT)
    assert code == 128 + signal.SIGINT
    assert lines == [f"moepack: stopped; the server answered 4 requests; wrote {out} (complete)"]
    trace = load_trace(out)
    segments = trace.prompt_segments
    assert len(segments) == len(prompts)
    # every token llama.cpp computed is in the trace, prefill and decode as /metrics counted
    prefill = served['moepack_tokens_total{phase="prefill"}']
    decode = served['moepack_tokens_total{phase="decode"}']
    assert trace.tokens == prefill + decode
    assert sum(s.prefill for s in segments) == prefill
    assert all(s.decode > 0 and s.prefill > 1 for s in segments)
    assert trace.ids.shape[1:] == (4, 4) and int(np.asarray(trace.ids).max()) < 32
    assert trace.provenance["capture"]["tool"] == "moepack serve"
    assert SECRET.encode() not in out.read_bytes()  # no request text unless asked
    plan = tmp_path / "plan.json"
    code, text, err = run_cli(
        capsys, "plan", model, "--trace", out, "--out", plan, "--holdout", "0.25", "--json"
    )
    assert code == 0, err
    held = json.loads(text)["held_out"]
    # judged on whole requests held out, as on the prompts of a capture
    assert held["by"] == "prompts" and held["held_out_prompts"] >= 1 and plan.exists()
    repacked = tmp_path / "repacked.gguf"
    code, _, err = run_cli(capsys, "repack", model, "--plan", plan, "--out", repacked, "-q")
    assert code == 0, err
    code, text, err = run_cli(
        capsys, "check-dropin", model, repacked, "--tokens", "128", "--json", "-q"
    )
    assert code == 0, err
    assert json.loads(text)["verdict"] == "PASS"
    code, text, err = run_cli(capsys, "analyse", model, out, "--json")
    assert code == 0, err
    assert len(json.loads(text)["layers"]) > 0


def test_the_trace_keeps_text_when_asked_and_stops_at_its_cap(model, tmp_path):
    out = tmp_path / "capped.moetrace"
    with Served(model, "--trace-out", out, "--trace-text", "--trace-max-bytes", "2K",
                "--threads", 1) as server:  # fmt: skip
        c = server.client()
        for i in range(6):  # each prompt new from its first word (no prefix kept)
            c.completions.create(model="m", prompt=f"{i} {SECRET}", max_tokens=16, temperature=0)
        code, lines = server.stop()
    assert code == 128 + signal.SIGTERM
    cap = [line for line in lines if "--trace-max-bytes" in line]
    assert len(cap) == 1 and "(2,048 bytes)" in cap[0], lines
    assert lines[-1] == f"moepack: stopped; the server answered 6 requests; wrote {out} (complete)"
    trace = load_trace(out)
    texts = trace.provenance["serve"]["texts"]
    assert 1 <= len(trace.prompt_segments) < 6
    assert len(texts) == len(trace.prompt_segments)
    # the prompt as llama.cpp renders its tokens (this vocabulary spells spaces as bytes of "▁")
    shown = [t["prompt"].replace("\u2581", " ").strip() for t in texts]
    assert shown == [f"{i} {SECRET}" for i in range(len(texts))]
    assert all(t["completion"] for t in texts)
    assert out.stat().st_size < 2048 + 4096  # the routing and text under the cap, plus a header


def test_a_port_in_use_is_one_line(model, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = run_cli(capsys, "serve", model, "--port", port)
    assert code == 2
    assert err.strip().splitlines() == [
        f"moepack: error: 127.0.0.1:{port}: cannot listen here: Address already in use"
    ]
    assert out == ""


def test_a_model_llama_cpp_aborts_on_is_one_line(model, tmp_path, capsys):
    raw = bytearray(model.read_bytes())
    key = b"qwen3moe.expert_used_count"
    at = raw.find(key)
    raw[at : at + len(key)] = b"qwen3moe.expert_used_cOunt"  # llama.cpp aborts without it
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(bytes(raw))
    code, out, err = run_cli(capsys, "serve", broken, "--port", 0)
    assert code == 2
    (line,) = err.strip().splitlines()
    assert line.startswith(f"moepack: error: {broken}: llama.cpp could not run this model"), line
    assert out == ""
