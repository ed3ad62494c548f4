"""llm-comply's conformance checks (PyPI, pinned in the test extra) run against ``moepack
serve``: OpenAI chat completions, Anthropic Messages and OpenAI Responses ("Open Responses"),
each check its own test.

The model is a synthetic one that answers any prompt with a short text and then its
end-of-sequence token at any temperature (``moefixtures.replying_model``): the checks ask for
``finish_reason`` "stop" and some text from requests that set no token limit. The suite runs
its reasoning and extended-thinking checks only for the names of models that reason, so it is
sent the names agents send (``gpt-5-mini``, ``claude-sonnet-4-5``), which the server takes by
``--alias`` globs. Checks that need what llama.cpp cannot do here (images, reasoning) are
expected to fail, with the reason: the server answers them with the API's own 400.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from moefixtures import replying_model
from served import Served

pytest.importorskip("llama_cpp.server", reason="moepack[serve] is installed by ./dev test")
pytest.importorskip("llm_comply", reason="the test extra installs llm-comply")
pytestmark = pytest.mark.slow

KEY = "sk-test-comply"
IMAGES = (
    "the model takes text: llama.cpp serves no image input here, so the request is refused "
    "with the API's 400 (OpenAI's invalid_request_error, Anthropic's invalid_request_error) "
    "instead of answered without the image"
)
REASONING = (
    "the model does not reason: reasoning_effort, a reasoning summary and extended thinking are "
    "refused with the API's 400 (OpenAI's unsupported_parameter, Anthropic's "
    "invalid_request_error) instead of answered without them"
)
EXPECTED_TO_FAIL = {
    "chat-image-input": IMAGES, "anth-image-input": IMAGES, "image-input": IMAGES,
    "chat-reasoning-summary": REASONING, "anth-thinking-display": REASONING,
    "reasoning-summary": REASONING,
}  # fmt: skip
ADVISED = {"compact-response"}
"""Checks that pass with the suite's advice (warnings): ``/v1/responses/compact`` is a 404, which
it takes (no response is stored, so there is nothing to compact)."""
OPENAI_CHECKS = [
    "chat-basic-response", "chat-system-prompt", "chat-multi-turn", "chat-tool-calling",
    "chat-streaming-response", "chat-streaming-usage", "chat-image-input",
    "chat-reasoning-summary", "chat-error-handling",
]  # fmt: skip
ANTHROPIC_CHECKS = [
    "anth-basic-response", "anth-system-prompt", "anth-multi-turn", "anth-tool-calling",
    "anth-streaming-response", "anth-streaming-usage", "anth-image-input",
    "anth-thinking-display", "anth-error-handling",
]  # fmt: skip
RESPONSES_CHECKS = [
    "basic-response", "system-prompt", "multi-turn", "tool-calling", "streaming-response",
    "streaming-usage", "image-input", "assistant-phase", "response-output-phase-schema",
    "compact-response", "compact-missing-model", "reasoning-summary", "error-handling",
]  # fmt: skip
ANTHROPIC_HEADERS = ["--auth-header", "x-api-key", "--no-bearer", "-H",
                     "anthropic-version:2023-06-01"]  # fmt: skip
FORMATS = {  # the suite's format: the model name it sends, its other arguments
    "openai-chat": ("gpt-5-mini", []),
    "anthropic": ("claude-sonnet-4-5", ANTHROPIC_HEADERS),
    "open-responses": ("gpt-5-mini", []),
}
ALIASES = ["--alias", "m", "--alias", "gpt-5*", "--alias", "claude-sonnet-4*"]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Served]:
    model = replying_model(tmp_path_factory.mktemp("comply") / "m.gguf")
    with Served(model, "--ctx", 2048, "--threads", 1, "--api-key", KEY, *ALIASES) as s:
        yield s


@pytest.fixture(scope="module")
def results(server) -> dict[str, dict[str, Any]]:
    """Every check's result, by id: llm-comply run once per format (its JSON report)."""
    tool = Path(sys.executable).parent / "llm-comply"
    out: dict[str, dict[str, Any]] = {}
    for fmt, (name, extra) in FORMATS.items():
        run = subprocess.run(
            [str(tool), "--format", fmt, "-u", server.url, "-m", name, "-k", KEY, "--json",
             "--timeout", "600", *extra],
            capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
        report = json.loads(run.stdout)
        out.update({r["id"]: r for r in report["results"]})
    return out


@pytest.mark.parametrize("check", OPENAI_CHECKS + ANTHROPIC_CHECKS + RESPONSES_CHECKS)
def test_llm_comply_check(results, check):
    result = results[check]
    if check in EXPECTED_TO_FAIL:  # failed as it must: the API's own error, not a silent drop
        assert result["status"] == "failed", result
        assert any("HTTP 400" in e for e in result.get("errors", [])), result
        pytest.xfail(EXPECTED_TO_FAIL[check])
    assert result["status"] == "passed", result
    if check not in ADVISED:
        assert not result.get("warnings"), result  # refusal, annotations, logprobs: all there
