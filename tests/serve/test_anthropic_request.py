"""An Anthropic Messages body read into llama-cpp-python's chat call, without a model: blocks
to OpenAI-form messages (tool calls and results, as calls or as plain turns), sampling
parameters and their defaults, the tool choices each chat format can honour, and every
refusal naming its field."""

from __future__ import annotations

from typing import Any

import pytest

from moepack.serve.anthropic_request import AnthropicError, read_call
from moepack.serve.names import ModelNames

DEFAULTS = {"top_p": 0.95, "top_k": 40, "min_p": 0.05, "repeat_penalty": 1.1}
USER = [{"role": "user", "content": "hi"}]
TOOL = {"name": "weather", "input_schema": {"type": "object"}}
NAMES = ModelNames.of([], "m")


def _call(chat_format: str = "llama-2", **body: Any) -> Any:
    return read_call({"model": "m", "max_tokens": 8, "messages": USER, **body}, NAMES,
                     chat_format, DEFAULTS)  # fmt: skip


def _refused(chat_format: str = "llama-2", **body: Any) -> AnthropicError:
    with pytest.raises(AnthropicError) as e:
        read_call({"model": "m", "max_tokens": 8, "messages": USER, **body}, NAMES,
                  chat_format, DEFAULTS)  # fmt: skip
    return e.value


def test_messages_and_sampling_become_the_chat_call():
    turns = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "calling"},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"unit": "c"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "text", "text": "so?"}]},
    ]  # fmt: skip
    call = _call(messages=turns, system=[{"type": "text", "text": "be brief"}],
                 stop_sequences=["\n\n"], temperature=0.5, top_k=7)  # fmt: skip
    kw = call.kwargs
    assert kw["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "calling", "tool_calls": [{"id": "toolu_1",
         "type": "function", "function": {"name": "weather", "arguments": '{"unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "so?"},
    ]  # fmt: skip
    assert call.tool_texts == ['{"unit": "c"}', "sunny"]  # what the prompt must then show
    assert kw["temperature"] == 0.5 and kw["top_k"] == 7 and kw["top_p"] == 0.95
    assert kw["stop"] == ["\n\n"] and kw["max_tokens"] == 8 and kw["repeat_penalty"] == 1.1
    assert _call().kwargs["temperature"] == 1.0  # Anthropic's default, not llama-cpp-python's
    assert _call(stream=True).stream


def test_tool_choices_map_to_what_the_chat_format_has():
    forced = _call(tools=[TOOL], tool_choice={"type": "tool", "name": "weather"})
    assert forced.forced_tool == "weather"
    assert forced.kwargs["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert forced.kwargs["tools"][0]["function"]["parameters"] == {"type": "object"}
    assert _call(tools=[TOOL], tool_choice={"type": "any"}).forced_tool == "weather"
    assert "tools" not in _call(tools=[TOOL], tool_choice={"type": "none"}).kwargs
    auto = _call("chatml-function-calling", tools=[TOOL])
    assert auto.kwargs["tool_choice"] == "auto" and auto.forced_tool is None
    assert "chatml-function-calling" in _refused(tools=[TOOL]).message
    two = [TOOL, {**TOOL, "name": "other"}]
    assert "'any'" in _refused("chatml-function-calling", tools=two,
                               tool_choice={"type": "any"}).message  # fmt: skip
    assert "not one of the tools" in _refused(tools=[TOOL], tool_choice={"type": "tool",
                                              "name": "x"}).message  # fmt: skip
    assert "client tools" in _refused(tools=[{"type": "web_search_20250305",
                                              "name": "web_search"}]).message  # fmt: skip


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"model": "claude-x"}, 404, "claude-x"),
        ({"max_tokens": None}, 400, "max_tokens: Field required"),
        ({"max_tokens": 0}, 400, "max_tokens: Input should be greater than or equal to 1"),
        ({"max_tokens": "8"}, 400, "max_tokens: Input should be a valid integer"),
        ({"temperature": 1.5}, 400, "temperature: Input should be between 0.0 and 1.0"),
        ({"top_k": -1}, 400, "top_k"),
        ({"stream": "yes"}, 400, "stream"),
        ({"stop_sequences": [""]}, 400, "stop_sequences"),
        ({"metadata": "me"}, 400, "metadata"),
        ({"messages": []}, 400, "messages: Input should be a non-empty list"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
         "messages.0.content.0: this model takes text; image blocks are not supported"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400,
         "takes text"),
        ({"messages": [*USER, {"role": "assistant", "content": "and"}]}, 400, "last message"),
        ({"messages": [{"role": "user", "content": [{"type": "thinking"}]}]}, 400, "thinking"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a",
          "name": "b"}]}]}, 400, "'tool_use' blocks are not supported in a user turn"),
        ({"system": [{"type": "image"}]}, 400, "system.0"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, 400, "thinking"),
        ({"tool_choice": {"type": "tool", "name": "weather"}}, 400, "needs tools"),
    ],
)  # fmt: skip
def test_every_refusal_names_its_field(body, status, words):
    e = _refused(**body)
    assert e.status == status and words in e.message, e.message
    assert e.kind == ("not_found_error" if status == 404 else "invalid_request_error")


def test_a_body_that_is_no_object_and_count_tokens_without_max_tokens():
    with pytest.raises(AnthropicError, match="JSON object"):
        read_call([1], NAMES, "llama-2", DEFAULTS)
    call = read_call({"model": "m", "messages": USER}, NAMES, "llama-2", DEFAULTS,
                     count_only=True)  # fmt: skip
    assert call.kwargs == {"messages": USER}
