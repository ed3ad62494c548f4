"""The quick deterministic request pass of moepack's fuzz harness (``serverfuzz.py``): a served
synthetic model sent a few hundred hostile requests — mutated bodies, tool schemas, grammars,
odd numbers, huge prompts, malformed HTTP — on every route of every API (OpenAI's,
Anthropic's, Ollama's), every answer a 2xx
or a 4xx in its route's own shape, within its ``max_tokens``, with nothing of the server's
insides, and the same worker throughout. ``scripts/fuzz.py`` runs the long pass."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp.server", reason="moepack[serve] is installed by ./dev test")
pytestmark = pytest.mark.slow

HARNESS = Path(__file__).with_name("harness.py")
QUICK_REQUESTS = 240  # 40 of each family, every route reached: about a minute here


def test_every_route_of_both_apis_answers_hostile_requests_in_its_shape(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(HARNESS), "--count", "0", "--paths", "none", "--seed", "0",
         "--requests", str(QUICK_REQUESTS), "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert not result["failures"], json.dumps(result["failures"][:5], indent=1)
    served = result["served"]
    assert served["requests"] == QUICK_REQUESTS
    assert min(served["per_route"].values()) > 0  # every route was sent requests
    assert set(served["per_family"].values()) == {QUICK_REQUESTS // len(served["per_family"])}


def test_the_request_pass_catches_what_it_is_for():
    """The verdict is not vacuous: a 500, an error out of its API's shape, a leak, a stream
    cut short and tokens past ``max_tokens`` are each failures."""
    sys.path.insert(0, str(HARNESS.parent))
    import serverfuzz as S

    chat = next(r for r in S.ROUTES if r.name == "openai-chat")
    messages = next(r for r in S.ROUTES if r.name == "anthropic-messages")
    req = S._request(chat, {"messages": S.USER, "max_tokens": 2})
    openai = json.dumps({"error": {"message": "m", "type": "t", "param": None, "code": None}})
    anthropic = json.dumps({"type": "error", "error": {"type": "t", "message": "m"}})
    js = {"content-type": "application/json"}
    sse = {"content-type": "text/event-stream"}
    assert S.verdict(req, 400, js, openai.encode()) is None
    assert S.verdict(req, 500, js, openai.encode()) is not None
    assert S.verdict(req, 400, js, anthropic.encode()) is not None  # the wrong API's shape
    assert S.verdict(req, 400, js, b"Invalid HTTP request received.") is not None
    assert S.verdict(req, 400, js, openai.replace('"m"', '"Traceback"').encode()) is not None
    assert S.verdict(req, 200, js, b'{"model": "/srv/models/m.gguf"}', "/srv/models") is not None
    assert S.verdict(req, 200, js, b'{"usage": {"completion_tokens": 3}}') is not None
    assert S.verdict(req, 200, js, b'{"usage": {"completion_tokens": 2}}') is None
    assert S.verdict(req, None, {}, b"") is not None
    assert S.verdict(req, 200, sse, b"data: {}\n\ndata: [DONE]\n\n") is None
    assert S.verdict(req, 200, sse, b"data: {}\n\n") is not None  # cut short
    req = S._request(messages, {"model": "m", "messages": S.USER, "max_tokens": 2})
    assert S.verdict(req, 404, js, anthropic.encode()) is None
    assert S.verdict(req, 404, js, openai.encode()) is not None
    stream = (b'data: {"type": "message_delta", "usage": {"output_tokens": 9}}\n\n'
              b'data: {"type": "message_stop"}\n\n')  # fmt: skip
    assert S.verdict(req, 200, sse, stream) is not None
    assert S.verdict(req, 200, sse, stream.replace(b"9", b"2")) is None
    # a Responses stream: numbered events ending completed (within max_output_tokens) or an error
    responses = next(r for r in S.ROUTES if r.name == "openai-responses-stream")
    req = S._request(responses, responses.body)
    done = (b'data: {"type": "response.created", "sequence_number": 0}\n\n'
            b'data: {"type": "response.completed", "sequence_number": 1, '
            b'"response": {"usage": {"output_tokens": 4}}}\n\n')  # fmt: skip
    assert S.verdict(req, 200, sse, done) is None
    assert S.verdict(req, 200, sse, done.replace(b": 4}", b": 5}")) is not None
    assert (
        S.verdict(req, 200, sse, done.replace(b'"sequence_number": 1', b'"sequence_number": 3'))
        is not None
    )
    assert S.verdict(req, 200, sse, done.split(b"\n\n")[0]) is not None  # cut short
    assert S.verdict(req, 200, {"content-type": "application/json"}, b"", "") is not None
    head = S._request(responses, None, method="HEAD")
    assert S.verdict(head, 200, {"content-type": "application/json"}, b"") is None  # no body
    # Ollama's: {"error": "…"}, JSON lines ending done (within num_predict) or in an error
    ollama = next(r for r in S.ROUTES if r.name == "ollama-chat-stream")
    req = S._request(ollama, ollama.body)
    lines = {"content-type": "application/x-ndjson"}
    assert S.verdict(req, 400, js, b'{"error": "m"}') is None
    assert S.verdict(req, 400, js, openai.encode()) is not None
    assert S.verdict(req, 200, lines, b'{"done": false}\n{"done": true, "eval_count": 4}\n') is None
    assert S.verdict(req, 200, lines, b'{"done": true, "eval_count": 5}\n') is not None
    assert S.verdict(req, 200, lines, b'{"done": false}\n') is not None  # cut short
    assert S.verdict(req, 200, lines, b'{"done": false}\n{"error": "m"}\n') is None
    assert S.verdict(req, 200, lines, b'{"done": false}\n{"error": {"x": 1}}\n') is not None
