"""The names a served model answers to (``--alias``, repeatable, globs), and Ollama's request
reading without a model: options onto llama.cpp's sampling, ``format``, what is refused."""

from __future__ import annotations

from typing import Any

import pytest

from moepack.serve.checks import Limits, RequestChecks, Vocabulary
from moepack.serve.names import ModelNames
from moepack.serve.ollama_request import OllamaError, budget, read_call

USER = [{"role": "user", "content": "hi"}]


def test_plain_names_and_globs():
    names = ModelNames.of(["qwen3", "claude-*", "gpt-?o"], "model")
    assert names.listed == ("qwen3",) and names.primary == "qwen3"
    for name in ("qwen3", "claude-sonnet-4-5", "claude-", "gpt-4o"):
        assert names.matches(name), name
    for name in ("model", "Claude-x", "gpt-4o-mini", "qwen", "qwen3:latest"):
        assert not names.matches(name), name
    assert names.matches("qwen3:latest", ollama=True)  # Ollama's tag for no tag
    said = names.unknown("gpt-5")
    assert "`gpt-5`" in said and "`qwen3`" in said and "`claude-*`" in said and "--alias" in said


def test_no_alias_is_the_file_name_and_only_globs_list_it():
    assert ModelNames.of([], "m").listed == ("m",) and ModelNames.of([], "m").matches("m")
    assert not ModelNames.of([], "m").matches("x")
    anything = ModelNames.of(["*"], "m")
    assert anything.listed == ("m",) and anything.matches("whatever/model:7b")
    assert ModelNames.from_job(anything.to_job()) == anything


def _checks(n_ctx: int = 1024) -> RequestChecks:
    return RequestChecks(
        Vocabulary(n_vocab=262, longest_piece=8, grammar=lambda text: None),
        Limits(n_ctx=n_ctx, max_prompt_tokens=n_ctx),
    )


def _read(chat: bool = True, chat_format: str = "llama-2", **body: Any) -> Any:
    data = {"model": "m", **({"messages": USER} if chat else {"prompt": "hi"}), **body}
    return read_call(data, ModelNames.of([], "m"), chat, chat_format, {"top_k": 40}, _checks())


def _refused(**kw: Any) -> OllamaError:
    with pytest.raises(OllamaError) as e:
        _read(**kw)
    return e.value


def test_options_map_onto_llama_cpp_sampling():
    call = _read(options={"temperature": 0.2, "mirostat": 2, "seed": -1, "num_predict": -1,
                          "stop": "END", "num_ctx": 512, "num_gpu": 99, "whatever": "x"})  # fmt: skip
    kw = call.kwargs
    assert kw["temperature"] == 0.2 and kw["mirostat_mode"] == 2 and kw["top_k"] == 40
    assert "seed" not in kw and kw["max_tokens"] is None and kw["stop"] == ["END"]
    assert call.stream is True and call.chat  # Ollama streams unless told not to
    assert _read(options={"num_predict": 7, "seed": 3}).kwargs["max_tokens"] == 7
    assert budget({"options": {"num_predict": 7}}) == 7 and budget({"options": {}}) is None
    assert _read(format="json").grammar and _read(format={"type": "object"}).grammar
    gen = _read(chat=False, system="be terse", context=[1, 5, 7])
    assert gen.messages[0] == {"role": "system", "content": "be terse"} and gen.context == [1, 5, 7]
    assert _read(chat=False, prompt="").load_only and _read(messages=[]).load_only


def test_what_a_text_model_cannot_do_is_refused_by_name():
    assert "--ctx" in _refused(options={"num_ctx": 4096}).message
    assert (
        "images" in _refused(messages=[{"role": "user", "content": "x", "images": ["A"]}]).message
    )
    assert "thinking" in _refused(think=True).message
    assert _read(think=False).chat
    assert (
        "chatml-function-calling"
        in _refused(tools=[{"type": "function", "function": {"name": "t"}}]).message
    )
    assert _read(chat_format="chatml-function-calling",
                 tools=[{"type": "function", "function": {"name": "t"}}]).tools  # fmt: skip
    assert "template" in _refused(chat=False, template="{{ .Prompt }}").message
    assert "seed" in _refused(options={"seed": -3}).message
    assert "num_predict" in _refused(options={"num_predict": -3}).message
    assert "format" in _refused(format="yaml").message
    assert "keep_alive" in _refused(keep_alive=[1]).message
    assert "context" in _refused(chat=False, context=[1, 999]).message
    e = _refused(model="other")
    assert e.status == 404 and "other" in e.message
