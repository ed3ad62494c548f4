"""An OpenAI Responses request (``POST /v1/responses``) read into the call llama-cpp-python's
chat API takes.

``instructions`` and ``input`` (a string, or items: messages of the user, assistant, system or
developer — a developer's is a system turn — with text parts; an assistant's ``function_call``
items and the ``function_call_output`` items answering them) become OpenAI-form chat messages,
so a conversation reads the same to the model as through ``/v1/chat/completions``.
``max_output_tokens``, ``temperature``, ``top_p`` and llama-cpp-python's own sampling fields a
client adds (``top_k``, ``min_p``, ``repeat_penalty``, ``seed``, ``logit_bias``, …) are passed
on; absent ones keep the defaults of llama-cpp-python's request type. ``text.format`` is plain
text, a JSON object or a JSON schema (a grammar, checked as every API's are). Function tools go
through llama-cpp-python's function calling as far as the chat format has it: a named
``tool_choice`` (or ``required`` with one tool) on every format, ``auto`` where the format
chooses (``chatml-function-calling``).

What the server cannot do is refused with OpenAI's 400, never dropped: image, audio and file
parts (the model takes text), built-in tools (web search, file search, …), ``reasoning`` (no
effort but ``none``, no summary: the model does not reason), ``previous_response_id`` and
item references (no response is stored), ``background``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .anthropic_request import AUTO_TOOLS
from .checks import INT32, RequestChecks, json_text, message_texts, sampling_values
from .names import ModelNames
from .shapes import ApiProblem

SAMPLING = ("temperature", "top_p")
EXTRAS = ("top_k", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty", "seed")
"""llama-cpp-python's sampling fields a client may add (the Responses API has not them)."""
TEXT_PARTS = ("input_text", "output_text", "text")
FORMAT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class ResponsesError(Exception):
    """A request answered with OpenAI's error shape."""

    def __init__(self, problem: ApiProblem) -> None:
        super().__init__(problem.message)
        self.problem = problem


def bad(message: str, param: str | None = None, code: str | None = None) -> ResponsesError:
    return ResponsesError(ApiProblem(400, message, param, code))


@dataclass
class ResponsesCall:
    """What ``create_chat_completion`` is called with, and what the answer echoes."""

    model: str
    stream: bool
    kwargs: dict[str, Any]
    auto: bool = False  # the chat format chooses between a message and a call
    echo: dict[str, Any] = field(default_factory=dict)


def read_call(
    data: Any,
    names: ModelNames,
    chat_format: str,
    defaults: dict[str, Any],
    checks: RequestChecks,
    verify: bool = True,
) -> ResponsesCall:
    """The call a ``/v1/responses`` body asks for (every part checked unless ``verify`` is
    off: the route reading a body the guard checked), or ``ResponsesError``."""
    if not isinstance(data, dict):
        raise bad("the request body must be a JSON object")
    model = data.get("model")
    if model is None:
        raise bad("Missing required parameter: 'model'.", "model", "missing_required_parameter")
    if not isinstance(model, str):
        raise bad(f"model: a string, got {json_text(model)}", "model")
    if not names.matches(model):
        raise ResponsesError(ApiProblem(404, names.unknown(model), "model", "model_not_found"))
    for name, why in (
        ("previous_response_id", "this server stores no responses: send the conversation in input"),
        ("background", "this server answers in the foreground only"),
    ):
        if data.get(name):
            raise bad(f"{name}: {why}", name)
    reasoning = data.get("reasoning")
    if isinstance(reasoning, dict) and any(
        v is not None and (k, v) != ("effort", "none") for k, v in reasoning.items()
    ):
        raise bad(
            "reasoning is not supported with this model (it does not reason: no effort, no "
            "summary)",
            "reasoning",
        )
    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad(f"stream: a boolean, got {json_text(stream)}", "stream")
    instructions = data.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions: a string", "instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + _input(
        data.get("input")
    )
    kwargs: dict[str, Any] = {**defaults, "messages": messages}
    numbers = {k: data[k] for k in (*SAMPLING, *EXTRAS) if data.get(k) is not None}
    problem = checks.numbers(numbers)
    if problem is not None:
        raise ResponsesError(problem)
    kwargs.update(sampling_values(numbers))
    limit = data.get("max_output_tokens")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= INT32:
            raise bad(
                f"max_output_tokens: an integer from 1, got {json_text(limit)}",
                "max_output_tokens",
                "integer_below_min_value",
            )
        kwargs["max_tokens"] = limit
    if "logit_bias" in data and data["logit_bias"] is not None:
        problem = checks.logit_bias(data["logit_bias"])
        if problem is not None:
            raise ResponsesError(problem)
        kwargs["logit_bias"] = {int(k): float(v) for k, v in data["logit_bias"].items()}
    call = ResponsesCall(model, stream, kwargs)
    tools, choice, schemas = _tools(data, chat_format, call)
    fmt, schema = _format(data.get("text"))
    if schema is not None:
        kwargs["response_format"] = {"type": "json_object", "schema": schema}
        schemas.append(("text.format.schema", schema))
    elif fmt["type"] == "json_object":
        kwargs["response_format"] = {"type": "json_object"}
    if verify:
        problem = checks.prompt_bytes(message_texts(messages), "input") or checks.schemas(schemas)
        if problem is not None:
            raise ResponsesError(problem)
    call.echo = {
        "instructions": instructions,
        "tools": tools,
        "tool_choice": choice,
        "text": {"format": fmt},
        "temperature": kwargs.get("temperature", 1.0),
        "top_p": kwargs.get("top_p", 1.0),
        "presence_penalty": kwargs.get("presence_penalty", 0.0),
        "frequency_penalty": kwargs.get("frequency_penalty", 0.0),
        "max_output_tokens": limit,
        "parallel_tool_calls": bool(data.get("parallel_tool_calls", True)),
        "truncation": "auto" if data.get("truncation") == "auto" else "disabled",
        "metadata": data.get("metadata") if isinstance(data.get("metadata"), dict) else {},
        "safety_identifier": _text_or_none(data.get("safety_identifier")),
        "prompt_cache_key": _text_or_none(data.get("prompt_cache_key")),
    }
    return call


def budget(data: Any) -> int | None:
    """The request's token budget (``Route.budget``): ``max_output_tokens``."""
    value = data.get("max_output_tokens") if isinstance(data, dict) else None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _input(value: Any) -> list[dict[str, Any]]:
    """``input`` as OpenAI-form chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad("input: a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where}: an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(str(item.get("role")))
            if role is None:
                raise bad(f"{where}.role: one of {', '.join(ROLES)}", f"{where}.role")
            out.append({"role": role, "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str):
                raise bad(f"{where}: a function call needs a name and arguments (a string)", where)
            call = {
                "id": str(call_id or f"call_{i}"),
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = json.dumps(output)
            out.append(
                {"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": output}
            )
        else:
            raise bad(
                f"{where}.type: {kind!r} items are not supported by this server (messages, "
                "function calls and their outputs are)",
                f"{where}.type",
            )
    return out


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(f"{where}.content: a string or a list of parts", f"{where}.content")
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            param = f"{where}.content[{j}].type"
            raise bad(
                f"Invalid content type. {kind} is not supported by this model: it takes text "
                "(llama.cpp serves no image, audio or file input here)",
                param,
                "unsupported_content_type",
            )
        texts.append(part["text"])
    return "".join(texts)


def _tools(
    data: dict[str, Any], chat_format: str, call: ResponsesCall
) -> tuple[list[dict[str, Any]], Any, list[tuple[str, Any]]]:
    """The tools as llama-cpp-python's keyword arguments on ``call``; the tools and choice the
    answer echoes, and the schemas a grammar may be made of."""
    tools = data.get("tools") or []
    choice = data.get("tool_choice", "auto" if tools else "none")
    if not isinstance(tools, list):
        raise bad("tools: a list", "tools")
    specs: list[dict[str, Any]] = []
    echoed: list[dict[str, Any]] = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad(
                f"tools[{i}]: only function tools are supported by this server, not {kind!r}",
                f"tools[{i}].type",
            )
        name, params = t.get("name"), t.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(name, str) or not name or not isinstance(params, dict):
            raise bad(f"tools[{i}]: a function needs a name and a parameters object", f"tools[{i}]")
        description = t.get("description")
        specs.append(
            {
                "type": "function",
                "function": {"name": name, "description": description or "", "parameters": params},
            }
        )
        strict = t.get("strict")
        echoed.append(
            {
                "type": "function",
                "name": name,
                "description": description if isinstance(description, str) else None,
                "parameters": params,
                "strict": strict if isinstance(strict, bool) else None,
            }
        )
    names = [s["function"]["name"] for s in specs]
    if choice in (None, "none") or not specs:
        if choice not in (None, "none", "auto"):
            raise bad(f"tool_choice: {json_text(choice)} needs tools", "tool_choice")
        return echoed, "none" if specs else "auto", []
    if choice == "required" and len(specs) == 1:
        choice = {"type": "function", "name": names[0]}
    if isinstance(choice, dict) and choice.get("type") == "function":
        if choice.get("name") not in names:
            raise bad(
                f"tool_choice: {json_text(choice.get('name'))} is not among the tools",
                "tool_choice",
            )
        call.kwargs.update(
            tools=specs, tool_choice={"type": "function", "function": {"name": choice["name"]}}
        )
        spec = specs[names.index(choice["name"])]
        return (
            echoed,
            {"type": "function", "name": choice["name"]},
            [(f"tools[{names.index(choice['name'])}].parameters", spec["function"]["parameters"])],
        )
    if choice == "required":
        raise bad(
            f'tool_choice "required" with {len(specs)} tools: this server makes a call of one '
            'tool (llama-cpp-python\'s chat formats have no "some tool"); give one tool, or '
            "name one",
            "tool_choice",
        )
    if choice != "auto":
        raise bad('tool_choice: "auto", "none", "required" or a function', "tool_choice")
    if chat_format not in AUTO_TOOLS:
        raise bad(
            f"tools: the chat format {chat_format!r} has no automatic tool choice in "
            "llama-cpp-python; serve with --chat-format chatml-function-calling, or name the "
            'tool (tool_choice {"type": "function", "name": …})',
            "tool_choice",
        )
    call.kwargs.update(tools=specs, tool_choice="auto")
    call.auto = True
    return (
        echoed,
        "auto",
        [(f"tools[{i}].parameters", s["function"]["parameters"]) for i, s in enumerate(specs)],
    )


def _format(text: Any) -> tuple[dict[str, Any], Any]:
    """``text.format`` as echoed (every field the response's schema requires), and the JSON
    schema it asks for (None: none)."""
    if text is None:
        return {"type": "text"}, None
    if not isinstance(text, dict):
        raise bad(f"text: an object, got {json_text(text)}", "text")
    fmt = text.get("format")
    if fmt is None:
        return {"type": "text"}, None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}, None
    if kind != "json_schema" or not isinstance(fmt, dict):
        raise bad(
            'text.format: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
            '"name": …, "schema": …}',
            "text.format.type",
        )
    name, schema, description = fmt.get("name"), fmt.get("schema"), fmt.get("description")
    if not isinstance(name, str) or not FORMAT_NAME.fullmatch(name):
        if name is None:
            raise bad(
                "Missing required parameter: 'text.format.name'.",
                "text.format.name",
                "missing_required_parameter",
            )
        raise bad(
            "text.format.name: letters, digits, underscores and dashes, at most 64",
            "text.format.name",
        )
    if not isinstance(schema, dict):
        raise bad("text.format.schema: a JSON schema (an object)", "text.format.schema")
    if description is not None and not isinstance(description, str):
        raise bad("text.format.description: a string", "text.format.description")
    strict = fmt.get("strict")
    echoed = {
        "type": "json_schema",
        "name": name,
        "description": description,
        "schema": schema,
        "strict": strict if isinstance(strict, bool) else False,
    }
    return echoed, schema
