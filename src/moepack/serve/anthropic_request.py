"""An Anthropic Messages request read into the call llama-cpp-python's chat API takes.

``system``, the turns and their blocks become OpenAI-form chat messages — the form
llama-cpp-python's chat formats render — so a conversation reads the same to the model
through ``/v1/messages`` as through ``/v1/chat/completions``: text as content, ``tool_use``
as an assistant's ``tool_calls``, ``tool_result`` as a ``tool`` message. Sampling parameters
Anthropic has (``temperature``, ``top_p``, ``top_k``, ``stop_sequences``) are passed on; the
ones it has not keep the defaults of llama-cpp-python's own request type (``min_p``,
``repeat_penalty``, …), and so do ``top_p`` and ``top_k`` when absent, so the two endpoints
sample alike.

Tools go through llama-cpp-python's function calling, as far as the chat format has it: a
named tool (``tool_choice`` ``tool``, or ``any`` with one tool) is a grammar-constrained call
on every chat format; ``auto`` (Anthropic's default when tools are given) needs a format
that decides between a message and a call itself, which llama-cpp-python's
``chatml-function-calling`` is. Anything else — ``auto`` or ``any`` of several on another
format, images and documents (the model takes text), server tools, extended thinking, an
assistant turn to continue — is a 400 naming why, never dropped.

The request is checked here field by field, not with the ``anthropic`` package's request
types: those are ``TypedDict``s whose blocks are an undiscriminated union of every block kind
Anthropic has, so pydantic's errors for one bad block list a dozen kinds it is not; the
message a client gets here names the field and what it must be.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .names import ModelNames

AUTO_TOOLS = ("chatml-function-calling",)
"""llama-cpp-python chat formats that choose between a message and a tool call themselves."""
TEXT_ONLY = ("image", "document", "search_result", "container_upload")


class AnthropicError(Exception):
    """A request answered with Anthropic's error shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


def bad(message: str) -> AnthropicError:
    return AnthropicError(400, message)


@dataclass
class MessagesCall:
    """What ``create_chat_completion`` is called with, and what the answer needs."""

    model: str
    stream: bool
    kwargs: dict[str, Any]
    stops: list[str] = field(default_factory=list)
    forced_tool: str | None = None
    tool_texts: list[str] = field(default_factory=list)  # what the prompt must show of them


def _int(data: dict[str, Any], name: str, low: int, required: bool = False) -> int | None:
    value = data.get(name)
    if value is None:
        if required:
            raise bad(f"{name}: Field required")
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad(f"{name}: Input should be a valid integer")
    if value < low:
        raise bad(f"{name}: Input should be greater than or equal to {low}")
    return value


def _float(data: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise bad(f"{name}: Input should be a valid number")
    if not low <= value <= high:
        raise bad(f"{name}: Input should be between {low} and {high}")
    return float(value)


def _text(blocks: Any, where: str) -> str:
    """A string, or text blocks joined (``system``, a tool result's content)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad(f"{where}: Input should be a string or a list of text blocks")
    parts = []
    for i, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind in TEXT_ONLY:
                raise bad(f"{where}.{i}: this model takes text; {kind} blocks are not supported")
            raise bad(f"{where}.{i}: Input should be a text block")
        parts.append(b["text"])
    return "\n".join(parts)


def chat_messages(
    data: dict[str, Any], as_text: bool = False, shown: list[str] | None = None
) -> list[dict[str, Any]]:
    """``system`` and ``messages`` in OpenAI's chat form; ``as_text``: tool calls and results
    as plain turns (for a chat format that leaves them out); ``shown`` receives the text of
    each call and result, which the prompt must then contain."""
    out: list[dict[str, Any]] = []
    system = data.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    messages = data.get("messages")
    if messages is None:
        raise bad("messages: Field required")
    if not isinstance(messages, list) or not messages:
        raise bad("messages: Input should be a non-empty list")
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad(f"{where}.role: Input should be 'user' or 'assistant'")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise bad(f"{where}.content: Input should be a string or a list of blocks")
        out.extend(_turn(m["role"], content, where, as_text, shown if shown is not None else []))
    if messages[-1].get("role") != "user":
        raise bad(
            "messages: the last message must be the user's (continuing an assistant "
            "turn is not supported by this server)"
        )
    return out


def _turn(
    role: str, blocks: list[Any], where: str, as_text: bool, shown: list[str]
) -> list[dict[str, Any]]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, b in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = b.get("type") if isinstance(b, dict) else None
        if not isinstance(b, dict) or not isinstance(kind, str):
            raise bad(f"{at}: Input should be a block with a type")
        if kind == "text":
            if not isinstance(b.get("text"), str):
                raise bad(f"{at}.text: Input should be a valid string")
            texts.append(b["text"])
        elif kind in TEXT_ONLY:
            raise bad(f"{at}: this model takes text; {kind} blocks are not supported")
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise bad(f"{at}: a tool_use block needs an id and a name")
            args = json.dumps(b.get("input", {}))
            shown.append(args)
            if as_text:
                texts.append(f"[tool_use {b['name']} id={b['id']}] {args}")
                continue
            calls.append(
                {
                    "id": b["id"],
                    "type": "function",
                    "function": {"name": b["name"], "arguments": args},
                }
            )
        elif kind == "tool_result" and role == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise bad(f"{at}.tool_use_id: Field required")
            text = _text(b.get("content", ""), f"{at}.content")
            if b.get("is_error"):
                text = f"Error: {text}"
            shown.append(text)
            if as_text:
                texts.append(f"[tool_result id={b['tool_use_id']}] {text}")
                continue
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
        elif kind in ("thinking", "redacted_thinking"):
            raise bad(f"{at}: {kind} blocks are not supported (this server does not think)")
        else:
            raise bad(f"{at}: {kind!r} blocks are not supported in a {role} turn")
    out: list[dict[str, Any]] = list(results)
    if role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    elif texts or not results:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def tools_of(data: dict[str, Any], chat_format: str) -> tuple[dict[str, Any], str | None]:
    """``tools`` and ``tool_choice`` as llama-cpp-python's keyword arguments, and the tool
    a call is forced to (None: the model chooses, or no tools)."""
    tools = data.get("tools")
    choice = data.get("tool_choice")
    if choice is not None and (not isinstance(choice, dict) or "type" not in choice):
        raise bad("tool_choice: Input should be an object with a type")
    kind = choice["type"] if choice else "auto"
    if not tools:
        if kind in ("any", "tool"):
            raise bad(f"tool_choice: {kind!r} needs tools")
        return {}, None
    if not isinstance(tools, list):
        raise bad("tools: Input should be a list")
    specs: list[dict[str, Any]] = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise bad(f"tools.{i}: a tool needs a name")
        if t.get("type") not in (None, "custom") or not isinstance(t.get("input_schema"), dict):
            raise bad(
                f"tools.{i}: only client tools (a name and an input_schema) are "
                f"supported, not {t.get('type')!r}"
            )
        specs.append(
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description", ""),
                    "parameters": t["input_schema"],
                },
            }
        )
    names = [s["function"]["name"] for s in specs]
    if kind == "none":
        return {}, None
    if kind == "tool" or (kind == "any" and len(names) == 1):
        name = choice.get("name") if kind == "tool" and choice else names[0]
        if name not in names:
            raise bad(f"tool_choice.name: {name!r} is not one of the tools ({', '.join(names)})")
        return {
            "tools": specs,
            "tool_choice": {"type": "function", "function": {"name": name}},
        }, name
    if kind == "any":
        raise bad(
            "tool_choice: 'any' of several tools is not supported (llama-cpp-python's "
            "function calling has no 'must call some tool'); name one (type 'tool')"
        )
    if kind != "auto":
        raise bad(
            f"tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none', not {kind!r}"
        )
    if chat_format not in AUTO_TOOLS:
        raise bad(
            f"tools: the chat format {chat_format!r} has no automatic tool choice in "
            "llama-cpp-python; serve with --chat-format chatml-function-calling, or "
            "name the tool (tool_choice type 'tool')"
        )
    return {"tools": specs, "tool_choice": "auto"}, None


def read_call(
    data: Any,
    names: ModelNames,
    chat_format: str,
    defaults: dict[str, Any],
    count_only: bool = False,
) -> MessagesCall:
    """The call a ``/v1/messages`` (or ``count_tokens``) body asks for, or ``AnthropicError``."""
    if not isinstance(data, dict):
        raise bad("the request body must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str):
        raise bad("model: Field required")
    if not names.matches(model):
        raise AnthropicError(404, f"model: {names.unknown(model)}", "not_found_error")
    thinking = data.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled"):
        raise bad("thinking: extended thinking is not supported by this server")
    shown: list[str] = []
    messages = chat_messages(data, shown=shown)
    tool_kwargs, forced = tools_of(data, chat_format)
    kwargs: dict[str, Any] = {"messages": messages, **tool_kwargs}
    if count_only:
        return MessagesCall(model, False, kwargs, forced_tool=forced, tool_texts=shown)
    max_tokens = _int(data, "max_tokens", 1, required=True)
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream: Input should be a valid boolean")
    stops = data.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop_sequences: Input should be a list of non-empty strings")
    metadata = data.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad("metadata: Input should be an object")
    temperature = _float(data, "temperature", 0.0, 1.0)
    top_p = _float(data, "top_p", 0.0, 1.0)
    top_k = _int(data, "top_k", 0)
    kwargs.update(defaults)
    kwargs.update(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,  # Anthropic's default
        stop=list(stops),
        stream=stream,
    )
    if top_p is not None:
        kwargs["top_p"] = top_p
    if top_k is not None:
        kwargs["top_k"] = top_k
    return MessagesCall(model, stream, kwargs, list(stops), forced, shown)
