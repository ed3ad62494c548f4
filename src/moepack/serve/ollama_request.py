"""An Ollama ``/api/chat`` or ``/api/generate`` body read into the call llama-cpp-python takes.

``/api/chat`` becomes ``create_chat_completion`` (its messages are already OpenAI's roles);
``/api/generate`` becomes ``create_completion`` of a prompt: with ``raw`` the prompt as given,
without it the chat template's rendering of ``system`` and ``prompt`` as one user turn (as
Ollama renders it), after the tokens of ``context`` when a client sends the conversation so
far. ``options`` map onto llama.cpp's sampling by name (``num_predict`` is ``max_tokens``;
``-1`` and ``-2``, Ollama's "no limit" and "fill the context", are the context; ``seed`` ``-1``
is a random seed; ``mirostat`` is ``mirostat_mode``); what is absent keeps the defaults of
llama-cpp-python's own request types, so the same conversation samples alike on every API.
``num_ctx`` above the served context is refused (the context is made once, at start); load
options (``num_gpu``, ``num_thread``, ``use_mmap``, …) and ones this server does not know are
ignored, as Ollama ignores an option a model does not use. ``format`` is ``"json"`` (llama.cpp's
JSON grammar) or a JSON schema (the grammar llama-cpp-python's converter makes of it, as
mended by ``schema_grammar``; its JSON grammar where it cannot convert one), checked by the
checks every API makes (``checks``).

What a text model served by llama.cpp cannot do is refused, never dropped: images (400, as
the other APIs), thinking (``think`` true or a level: 400, as Ollama answers a model without
thinking; false is accepted), a Go ``template`` of the request's own, ``suffix`` (fill in the
middle), tools where the chat format cannot choose between a message and a call (Ollama has
no ``tool_choice``: the model always chooses, which llama-cpp-python's
``chatml-function-calling`` alone does). ``keep_alive`` is accepted (a
duration string or seconds) and changes nothing: the one model stays loaded while the server
runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .anthropic_request import AUTO_TOOLS
from .checks import INT32, RequestChecks, json_text, sampling_values
from .names import ModelNames
from .shapes import ApiProblem
from .validate import MAX_STOPS

OPTIONS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "typical_p": "typical_p",
    "repeat_penalty": "repeat_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "mirostat": "mirostat_mode",
    "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta",
    "seed": "seed",
}
"""Ollama's sampling options and llama-cpp-python's names for them (``num_predict`` and
``stop`` are read on their own)."""
SAMPLING_DEFAULTS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "typical_p",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    "mirostat_mode",
    "mirostat_tau",
    "mirostat_eta",
)
"""The fields whose defaults are llama-cpp-python's request types' when an option is absent
(``typical_p`` has none there: ``create_completion``'s own, 1.0)."""
ROLES = ("system", "user", "assistant", "tool")


class OllamaError(Exception):
    """A request answered ``{"error": message}`` with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    @property
    def problem(self) -> ApiProblem:
        return ApiProblem(self.status, self.message)


def bad(message: str) -> OllamaError:
    return OllamaError(400, message)


@dataclass
class OllamaCall:
    """What llama-cpp-python is called with (``chat``: ``create_chat_completion``, else
    ``create_completion`` of ``messages`` rendered, or of ``prompt`` when ``raw``) and what
    the answer needs."""

    model: str
    chat: bool
    stream: bool
    kwargs: dict[str, Any]
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt: str = ""
    raw: bool = False
    context: list[int] = field(default_factory=list)
    load_only: bool = False  # nothing to generate: the model is "loaded" (done_reason load)
    tools: bool = False
    grammar: str | None = None  # GBNF of ``format``


def model_of(data: Any, names: ModelNames, key: str = "model") -> str:
    """The model a body names (``model``; ``name`` too, as Ollama's older clients send it)."""
    if not isinstance(data, dict):
        raise bad("the request body must be a JSON object")
    model = data.get(key, data.get("name"))
    if model is None or model == "":
        raise bad("model is required")
    if not isinstance(model, str):
        raise bad(f"model must be a string, got {json_text(model)}")
    if not names.matches(model, ollama=True):
        raise OllamaError(404, f'model "{model[:200]}" not found: {names.unknown(model)}')
    return model


def read_call(
    data: Any,
    names: ModelNames,
    chat: bool,
    chat_format: str,
    defaults: dict[str, Any],
    checks: RequestChecks,
    verify: bool = True,
) -> OllamaCall:
    """The call a ``/api/chat`` (``chat``) or ``/api/generate`` body asks for, its every part
    checked (``checks``), or ``OllamaError``; ``verify`` False: the route reading a body the
    guard checked so (its grammars and schemas are not parsed again)."""
    model = model_of(data, names)
    stream = data.get("stream", True)  # Ollama streams unless told not to
    if stream is None:
        stream = True
    if not isinstance(stream, bool):
        raise bad(f"stream must be a boolean, got {json_text(stream)}")
    keep_alive(data.get("keep_alive"))
    _think(data.get("think"))
    kwargs = _options(data.get("options"), checks, defaults)
    call = OllamaCall(model, chat, stream, kwargs)
    call.grammar = _format(data.get("format"), checks, verify)
    if chat:
        call.messages = _messages(data.get("messages"))
        call.load_only = not call.messages
        tools = _tools(data.get("tools"), chat_format, checks, verify)
        if tools:
            call.tools = True
            kwargs.update(tools=tools, tool_choice="auto")
        texts = [m["content"] for m in call.messages if isinstance(m.get("content"), str)]
        problem = checks.prompt_bytes(texts, "messages")
    else:
        if data.get("tools"):
            raise bad("tools are taken by /api/chat, not /api/generate")
        call.prompt = _string(data, "prompt")
        system = _string(data, "system")
        if _string(data, "template"):
            raise bad(
                "template: a request's own Go template is not supported (the model's chat "
                "template renders the prompt); send raw: true with the prompt rendered"
            )
        if _string(data, "suffix"):
            raise bad("suffix: fill-in-the-middle is not supported by this server")
        _images(data.get("images"), "images")
        raw = data.get("raw", False)
        if raw is not None and not isinstance(raw, bool):
            raise bad(f"raw must be a boolean, got {json_text(raw)}")
        call.raw = bool(raw)
        call.context = _context(data.get("context"), checks)
        call.load_only = not call.prompt and not system and not call.context
        if not call.raw:
            call.messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": call.prompt}
            ]
        elif system:
            raise bad("system: a raw prompt takes no system message (render it into the prompt)")
        problem = checks.prompt_bytes([call.prompt, system], "prompt")
        if problem is None and len(call.context) > checks.limits.max_prompt_tokens:
            problem = checks.too_many(len(call.context), "context")
    if problem is not None and verify:
        raise OllamaError(problem.status, problem.message)
    return call


def budget(data: Any) -> int | None:
    """The request's token budget (``Route.budget``): ``options.num_predict`` when positive."""
    options = data.get("options") if isinstance(data, dict) else None
    value = options.get("num_predict") if isinstance(options, dict) else None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


# -- parts ----------------------------------------------------------------------------------


def _string(data: dict[str, Any], name: str) -> str:
    value = data.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise bad(f"{name} must be a string, got {json_text(value)}")
    return value


def keep_alive(value: Any) -> None:
    """A duration (``"5m"``, ``"-1"``) or a number of seconds: accepted, changing nothing."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, str | int | float)):
        raise bad(f"keep_alive must be a duration or a number of seconds, got {json_text(value)}")


def _think(value: Any) -> None:
    if value is None or value is False:
        return
    if value is True or value in ("high", "medium", "low"):
        raise bad(
            "think: this model does not support thinking (llama.cpp renders its chat "
            "template and gives one text; there is no separate reasoning output)"
        )
    raise bad(f'think must be a boolean or "high", "medium", "low", got {json_text(value)}')


def _images(value: Any, where: str) -> None:
    if value is None or value == []:
        return
    raise bad(f"{where}: this model takes text; images are not supported")


def _options(options: Any, checks: RequestChecks, defaults: dict[str, Any]) -> dict[str, Any]:
    """``options`` as llama-cpp-python's keyword arguments, every value checked."""
    kwargs = dict(defaults)
    if options is None:
        return kwargs
    if not isinstance(options, dict):
        raise bad(f"options must be an object, got {json_text(options)}")
    fields: dict[str, Any] = {}
    for name, value in options.items():
        if value is None:
            continue
        target = OPTIONS.get(name)
        if target is not None:
            if name == "seed" and value == -1:  # Ollama's random seed
                continue
            fields[target] = value
    problem = checks.numbers(fields)
    if problem is not None:
        raise bad(f"options: {problem.message}")
    kwargs.update(sampling_values(fields))
    predict = options.get("num_predict")
    if predict is not None:
        if isinstance(predict, bool) or not isinstance(predict, int | float):
            raise bad(f"options: `num_predict` must be an integer, got {json_text(predict)}")
        if predict != int(predict) or not -2 <= predict <= INT32:
            raise bad(
                "options: `num_predict` must be an integer from -2 (fill the context) and -1 "
                f"(no limit) to {INT32:,}, got {json_text(predict)}"
            )
        kwargs["max_tokens"] = int(predict) if predict > 0 else None
    ctx = options.get("num_ctx")
    if ctx is not None:
        if isinstance(ctx, bool) or not isinstance(ctx, int | float) or ctx != int(ctx):
            raise bad(f"options: `num_ctx` must be an integer, got {json_text(ctx)}")
        if ctx > checks.limits.n_ctx:
            raise bad(
                f"options: `num_ctx` {int(ctx):,} is more than the context this server runs "
                f"({checks.limits.n_ctx:,} tokens, made once at start: moepack serve --ctx N)"
            )
    stop = options.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise bad("options: `stop` must be a string or a list of non-empty strings")
        if len(stops) > MAX_STOPS:
            raise bad(f"options: `stop` holds {len(stops)} sequences; at most {MAX_STOPS}")
        kwargs["stop"] = list(stops)
    return kwargs


def _format(value: Any, checks: RequestChecks, verify: bool = True) -> str | None:
    """The GBNF grammar ``format`` asks for (None: free text), checked as every API's are."""
    from llama_cpp.llama_grammar import JSON_GBNF

    from .schema_grammar import grammar_of

    if value is None or value == "":
        return None
    if value == "json":
        text = JSON_GBNF
    elif isinstance(value, dict):
        problem = checks.schema(value, "format") if verify else None
        if problem is not None:
            raise bad(f"format: {problem.message}")
        try:
            text = grammar_of(value)
        except Exception:  # as the chat handlers do: the JSON grammar instead
            text = JSON_GBNF
    else:
        raise bad(f'format must be "json" or a JSON schema object, got {json_text(value)}')
    problem = checks.grammar(text, "format") if verify else None
    if problem is not None:
        raise bad(f"format: {problem.message}")
    return text


def _messages(value: Any) -> list[dict[str, Any]]:
    """Ollama's messages as OpenAI-form ones (the form llama-cpp-python's chat formats render):
    an assistant's ``tool_calls`` with their arguments as JSON text, a tool's result as a
    ``tool`` message naming its tool."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad("messages must be a list")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {json_text(role)}")
        content = m.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad(f"{where}.content must be a string")
        _images(m.get("images"), f"{where}.images")
        message: dict[str, Any] = {"role": role, "content": content}
        calls = m.get("tool_calls")
        if calls:
            if role != "assistant" or not isinstance(calls, list):
                raise bad(f"{where}.tool_calls: a list, in an assistant's message")
            message["tool_calls"] = [
                _call(c, f"{where}.tool_calls[{j}]", i, j) for j, c in enumerate(calls)
            ]
        if role == "tool":
            name = m.get("tool_name", m.get("name"))
            if name is not None and not isinstance(name, str):
                raise bad(f"{where}.tool_name must be a string")
            message["tool_call_id"] = name or "tool"
            if name:
                message["name"] = name
        out.append(message)
    return out


def _call(value: Any, where: str, i: int, j: int) -> dict[str, Any]:
    fn = value.get("function") if isinstance(value, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(f"{where}: a call needs a function with a name")
    args = fn.get("arguments", {})
    if not isinstance(args, dict):
        raise bad(f"{where}.function.arguments must be an object")
    return {
        "id": str(value.get("id") or f"call_{i}_{j}"),
        "type": "function",
        "function": {"name": fn["name"], "arguments": json.dumps(args)},
    }


def _tools(
    value: Any, chat_format: str, checks: RequestChecks, verify: bool = True
) -> list[dict[str, Any]]:
    if not value:
        return []
    if not isinstance(value, list):
        raise bad("tools must be a list")
    specs: list[dict[str, Any]] = []
    for i, t in enumerate(value):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"tools[{i}]: a tool needs a function with a name")
        if t.get("type", "function") != "function":
            raise bad(f'tools[{i}].type must be "function"')
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON schema object")
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise bad(f"tools[{i}].function.description must be a string")
        specs.append(
            {
                "type": "function",
                "function": {"name": fn["name"], "description": description, "parameters": params},
            }
        )
    if chat_format not in AUTO_TOOLS:
        raise bad(
            f"tools: the chat format {chat_format!r} has no automatic tool choice in "
            "llama-cpp-python (Ollama's API lets the model choose between a message and a "
            "call); serve with --chat-format chatml-function-calling"
        )
    problem = None
    if verify:
        problem = checks.schemas(
            (f"tools[{i}].function.parameters", s["function"]["parameters"])
            for i, s in enumerate(specs)
        )
    if problem is not None:
        raise bad(problem.message)
    return specs


def _context(value: Any, checks: RequestChecks) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise bad("context must be a list of token ids")
    problem = checks.token_ids(value, "context")
    if problem is not None:
        raise bad(problem.message)
    return list(value)
