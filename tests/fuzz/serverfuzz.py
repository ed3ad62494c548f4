"""The harness's request pass: ``moepack serve`` on a synthetic model, sent hostile requests on
every route of every API it has — OpenAI's chat and text completions, tokenize and models;
Anthropic's messages, count_tokens and models (``/v1/models`` as the Anthropic SDK asks it);
Ollama's chat and generate (streamed and not), show, tags, ps, version and embed; the pages —
until each route has had its share.

Request families (``FAMILIES``), each drawn for a route: ``mutated`` (a valid body with 1-3
values replaced by wrong types, extremes, deep nesting: the readers' mutator), ``schemas``
(tools and ``response_format`` whose JSON schemas make grammars llama.cpp refuses, cannot
finish or takes long to parse: quotes, backslashes, control characters and NUL in names and
values, empty ``anyOf``/``enum``, regex escapes and huge counts in patterns, self references,
huge ``maxLength``/``minItems``, every ``tool_choice``; Ollama's ``format`` and ``tools``),
``grammars`` (raw GBNF: unparseable,
nested 30,000 deep, NUL, token ids past the vocabulary, left recursion), ``numbers`` (float,
huge, negative, string and boolean seeds; sampling fields out of range or of the wrong type;
``logit_bias`` with ids outside the vocabulary, text keys, huge or non-number values;
``max_tokens`` 0, -1, 2**40, 1.5; ``n``, ``best_of``, ``logprobs``, many ``stop``s; Ollama's
``options`` alike, and its ``context``, ``keep_alive``, ``think``, ``images``; embed's
``truncate``, ``dimensions`` and ``input``), ``prompts``
(one long word, megabytes of text under ``--max-body``, every plane of Unicode, empty turns),
``http`` (bodies that are not JSON, the wrong content type, a ``Content-Length`` that is no
number or larger than ``--max-body``, other methods, unknown paths under each API).

Every answer must be a 2xx or a 4xx (a 503 only while stopping): a 4xx in its route's own
error shape (OpenAI's ``{"error": {message, type, param, code}}``, Anthropic's ``{"type":
"error", "error": {type, message}}``, Ollama's ``{"error": message}``), a 2xx whole (JSON, an
event stream that ends as its API ends one, or Ollama's JSON lines ending ``done: true`` or in
an error), never past the request's ``max_tokens`` (``num_predict``), and nothing of the server's
insides (a traceback, a path) in any of it; the worker answering the first request answers
the last (a worker that died and was started again is a failure, blamed on the request sent
just before).
"""

from __future__ import annotations

import copy
import http.client
import json
import random
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REQUEST_SECONDS = 120  # one request's answer, generation included, on a tiny model
LEAKS = ("Traceback", "site-packages", '.py"', ".py'", 'File "', "numpy")
USER = [{"role": "user", "content": "the quick brown fox"}]
OBJECT = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}
ANTHROPIC_HEADERS = {"x-api-key": "none", "anthropic-version": "2023-06-01"}
OLLAMA_OPTIONS = {"num_predict": 4, "temperature": 0}


@dataclass(frozen=True)
class Route:
    """A route the server answers: its method, path, API (whose error shape it answers in)
    and a valid body."""

    name: str
    method: str
    path: str
    api: str
    body: dict[str, Any] | None = None
    headers: tuple[tuple[str, str], ...] = ()


ROUTES = [
    Route("openai-chat", "POST", "/v1/chat/completions", "openai",
          {"model": "m", "messages": USER, "max_tokens": 4}),
    Route("openai-chat-stream", "POST", "/v1/chat/completions", "openai",
          {"model": "m", "messages": USER, "max_tokens": 4, "stream": True}),
    Route("openai-completions", "POST", "/v1/completions", "openai",
          {"model": "m", "prompt": "the quick", "max_tokens": 4}),
    Route("openai-completions-stream", "POST", "/v1/completions", "openai",
          {"model": "m", "prompt": "the quick", "max_tokens": 4, "stream": True}),
    Route("openai-tokenize", "POST", "/extras/tokenize", "openai", {"input": "the quick"}),
    Route("openai-detokenize", "POST", "/extras/detokenize", "openai", {"tokens": [5, 6, 7]}),
    Route("openai-models", "GET", "/v1/models", "openai"),
    Route("anthropic-messages", "POST", "/v1/messages", "anthropic",
          {"model": "m", "max_tokens": 4, "messages": USER}, tuple(ANTHROPIC_HEADERS.items())),
    Route("anthropic-messages-stream", "POST", "/v1/messages", "anthropic",
          {"model": "m", "max_tokens": 4, "messages": USER, "stream": True},
          tuple(ANTHROPIC_HEADERS.items())),
    Route("anthropic-count-tokens", "POST", "/v1/messages/count_tokens", "anthropic",
          {"model": "m", "messages": USER}, tuple(ANTHROPIC_HEADERS.items())),
    Route("anthropic-models", "GET", "/v1/models", "openai", None,
          tuple(ANTHROPIC_HEADERS.items())),
    Route("openai-responses", "POST", "/v1/responses", "openai",
          {"model": "m", "input": "the quick", "max_output_tokens": 4}),
    Route("openai-responses-stream", "POST", "/v1/responses", "openai",
          {"model": "m", "input": USER, "max_output_tokens": 4, "stream": True}),
    Route("ollama-chat", "POST", "/api/chat", "ollama",
          {"model": "m", "messages": USER, "stream": False, "options": OLLAMA_OPTIONS}),
    Route("ollama-chat-stream", "POST", "/api/chat", "ollama",
          {"model": "m", "messages": USER, "options": OLLAMA_OPTIONS}),
    Route("ollama-generate", "POST", "/api/generate", "ollama",
          {"model": "m", "prompt": "the quick", "stream": False, "options": OLLAMA_OPTIONS}),
    Route("ollama-generate-stream", "POST", "/api/generate", "ollama",
          {"model": "m", "prompt": "the quick", "options": OLLAMA_OPTIONS}),
    Route("ollama-show", "POST", "/api/show", "ollama", {"model": "m"}),
    Route("ollama-embed", "POST", "/api/embed", "ollama", {"model": "m", "input": "the quick"}),
    Route("ollama-tags", "GET", "/api/tags", "ollama"),
    Route("ollama-ps", "GET", "/api/ps", "ollama"),
    Route("ollama-version", "GET", "/api/version", "ollama"),
    Route("pages", "GET", "/metrics", "openai"),
]  # fmt: skip
RESPONSES = {r.name for r in ROUTES if r.path == "/v1/responses"}
GENERATING = {r.name for r in ROUTES if r.body is not None and "max_tokens" in r.body} | RESPONSES
OLLAMA_GENERATING = {r.name for r in ROUTES if r.body is not None and "options" in r.body}


# ---------------------------------------------------------------- request families
@dataclass
class Request:
    """One request to send: the body as bytes (None: none), and headers beyond the route's."""

    route: Route
    body: bytes | None
    headers: dict[str, str]
    method: str
    path: str
    max_tokens: int | None = None  # what the answer may not exceed


Mutate = Callable[[Any, random.Random], bytes]
"""The readers' JSON mutator: a document, mutated, as the bytes to send."""


def _request(route: Route, body: Any, **kw: Any) -> Request:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json", **dict(route.headers), **kw.pop("headers", {})}
    return Request(route, data, headers, kw.pop("method", route.method),
                   kw.pop("path", route.path), _max_tokens(route, body))  # fmt: skip


def _max_tokens(route: Route, body: Any) -> int | None:
    """The most tokens a request's answer may say it sampled (None: no bound to check)."""
    if not isinstance(body, dict):
        return None
    if route.api == "ollama":
        options = body.get("options")
        max_tokens = options.get("num_predict") if isinstance(options, dict) else None
        if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0:
            return max_tokens
        return None
    max_tokens = body.get("max_output_tokens" if route.path == "/v1/responses" else "max_tokens")
    if route.path == "/v1/completions" and "max_tokens" not in body:
        max_tokens = 16  # llama-cpp-python's default
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0:
        return max_tokens
    return None


def mutated(route: Route, rng: random.Random, mutate: Mutate) -> Request:
    if route.body is None:
        query = rng.choice(["", "?limit=0", "?after_id=" + "x" * 5000, "?%ff=%00"])
        return _request(route, None, path=route.path + query)
    for _ in range(3):  # a mutation that went through a value an earlier one replaced: again
        try:
            body = mutate(copy.deepcopy(route.body), rng)
        except (TypeError, KeyError, IndexError, ValueError):
            continue
        req = _request(route, body)
        try:
            req.max_tokens = _max_tokens(route, json.loads(body))
        except (ValueError, RecursionError):  # 5,000 digits, 3,000 levels: not read here
            pass
        return req
    return _request(route, route.body)


HOSTILE_SCHEMAS: list[Any] = [
    {"type": "object", "properties": {'a"b': {"type": "string"}}},
    {"type": "object", "properties": {"a\\b": {"type": "string"}, "c\nd": {"type": "integer"}}},
    {"type": "object", "properties": {"\u0000": {"type": "string"}}},
    {"enum": ['a"b', "\\", "\u0000", "\u001f", "😀"]},
    {"const": "\u0000"},
    {"anyOf": []}, {"oneOf": []}, {"allOf": []}, {"enum": []},
    {"type": "string", "pattern": "^\\$"}, {"type": "string", "pattern": "^\\d{3}\\w+$"},
    {"type": "string", "pattern": "^a{0,1000000000}$"}, {"type": "string", "pattern": "^(a|b"},
    {"type": "string", "pattern": "^.*$"}, {"type": "string", "pattern": '^["\\\\]+$'},
    {"$ref": "#"}, {"$ref": "#/"}, {"$ref": "https://example.invalid/schema.json"},
    {"type": "object", "properties": {"x": {"$ref": "#/properties/x"}}},
    {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
    {"type": "string", "maxLength": 100_000}, {"type": "string", "minLength": 10**9},
    {"type": "array", "items": {"type": "integer"}, "minItems": 10**8},
    {"type": "array", "maxItems": -1}, {"type": "integer", "minimum": 10**30, "maximum": 1},
    {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}},
    {"type": ["string", "null", "object"]}, {"type": "nothing"}, {"format": "date-time"},
    {"type": "object", "additionalProperties": {"type": "object", "additionalProperties": {}}},
    {"not": {}}, True, False, None, [], "string", 5,
    OBJECT,
]  # fmt: skip
TOOL_CHOICES_OPENAI: list[Any] = [None, "auto", "none", "required", "any", {"type": "function"},
                                  {"type": "function", "function": {"name": "t"}},
                                  {"type": "function", "function": {"name": "nope"}}, 5]  # fmt: skip
TOOL_CHOICES_ANTHROPIC: list[Any] = [None, {"type": "auto"}, {"type": "any"}, {"type": "none"},
                                     {"type": "tool", "name": "t"}, {"type": "tool"},
                                     {"type": "tool", "name": "nope"}, {"type": "x"}, "auto"]  # fmt: skip


def schemas(route: Route, rng: random.Random, mutate: Any) -> Request:
    schema = copy.deepcopy(rng.choice(HOSTILE_SCHEMAS))
    n = rng.choice([1, 1, 2])
    stream = rng.random() < 0.3
    if route.api == "anthropic" and route.body is not None:
        tools = [{"name": "t" if i == 0 else f"t{i}", "input_schema": schema,
                  "description": "a tool"} for i in range(n)]  # fmt: skip
        body = {**route.body, "tools": tools, "max_tokens": rng.choice([1, 8, 32])}
        choice = rng.choice(TOOL_CHOICES_ANTHROPIC)
        if choice is not None:
            body["tool_choice"] = choice
        if stream and route.path == "/v1/messages":
            body["stream"] = True
        return _request(route, body)
    if route.name in RESPONSES and route.body is not None:
        body = {**route.body, "max_output_tokens": rng.choice([1, 8, 32])}
        if rng.random() < 0.3:
            body["text"] = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
        else:
            body["tools"] = [{"type": "function", "name": "t" if i == 0 else f"t{i}",
                              "parameters": schema} for i in range(n)]  # fmt: skip
            choice = rng.choice([None, "auto", "none", "required", {"type": "function",
                                 "name": "t"}, {"type": "function", "name": "nope"}, 5])  # fmt: skip
            if choice is not None:
                body["tool_choice"] = choice
        return _request(route, body)
    if route.api == "ollama":
        target = rng.choice([r for r in ROUTES if r.name in OLLAMA_GENERATING])
        body = copy.deepcopy(target.body or {})
        body["options"] = {"num_predict": rng.choice([1, 8, 32])}
        if target.path == "/api/chat" and rng.random() < 0.4:
            body["tools"] = [{"type": "function", "function": {"name": f"t{i}", "parameters": schema}}
                             for i in range(n)]  # fmt: skip
        else:
            body["format"] = rng.choice([schema, schema, "json", "yaml", {"type": "object"}])
        return _request(target, body)
    chat = next(r for r in ROUTES if r.name == "openai-chat")
    body = {**(chat.body or {}), "max_tokens": rng.choice([1, 8, 32]), "stream": stream}
    if rng.random() < 0.25:
        body["response_format"] = {"type": rng.choice(["json_object", "json_schema", "text"]),
                                   "schema": schema}  # fmt: skip
    else:
        body["tools"] = [{"type": "function", "function": {"name": "t" if i == 0 else f"t{i}",
                                                           "parameters": schema}}
                         for i in range(n)]  # fmt: skip
        choice = rng.choice(TOOL_CHOICES_OPENAI)
        if choice is not None:
            body["tool_choice"] = choice
    return _request(chat, body)


HOSTILE_GRAMMARS = [
    "x", "root ::= [", 'root ::= "\\x00"', 'root ::= "ab" "\\x00"', "root ::= <[99999]>",
    "root ::= <[2]>", "root ::= <[-1]>", 'root ::= "\\UFFFFFFFF"', 'root ::= x\nx ::= x "a"',
    "root ::= " + "(" * 30_000 + '"a"' + ")" * 30_000,
    "root ::= " + " | ".join(f'"a{i}"' for i in range(20_000)),
    'root ::= "a"{0,1000000}', 'root ::= "a"{100000}', 'root ::= [^\\x00-\\U0010FFFF]',
    'root ::= "a" root2\nroot2 ::= ', "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n"
                                                                for i in range(8000)) + 'r8000 ::= "a"',
    'root ::= "ab"', 'root ::= [a-z]+ "."',
]  # fmt: skip


def grammars(route: Route, rng: random.Random, mutate: Any) -> Request:
    target = rng.choice([r for r in ROUTES if r.name.startswith(("openai-chat", "openai-comp"))])
    body = {**(target.body or {}), "grammar": rng.choice(HOSTILE_GRAMMARS),
            "max_tokens": rng.choice([1, 8, 32])}  # fmt: skip
    if rng.random() < 0.3:
        body["logit_bias"] = {"5": -1}
    return _request(target, body)


ODD_NUMBERS: list[Any] = [1.5, 1e30, -1, -1.5, 2**32, 2**31, 2**63, 2**64, 10**30, True, False,
                          "5", "nan", "inf", None, [], {}, 0, 0.0, 1e-320, -0.0, 7]  # fmt: skip
NUMBER_FIELDS = ["seed", "temperature", "top_p", "top_k", "min_p", "typical_p", "repeat_penalty",
                 "presence_penalty", "frequency_penalty", "mirostat_mode", "mirostat_tau",
                 "mirostat_eta", "max_tokens", "n", "best_of", "logprobs", "top_logprobs",
                 "min_tokens", "tfs_z", "max_output_tokens"]  # fmt: skip
ODD_BIASES: list[Any] = [{"99999": 1}, {"-1": 1}, {"x": 1}, {"5": 1000}, {"5": "nan"}, {"5": True},
                         {"1.5": 1}, {" 5": 1}, {str(i): -100 for i in range(300)}, [5], "5",
                         {"5": -100}, {"5": 100}, {"7" * 5000: 1}]  # fmt: skip


OLLAMA_FIELDS = ["seed", "temperature", "top_p", "top_k", "min_p", "typical_p", "repeat_penalty",
                 "presence_penalty", "frequency_penalty", "mirostat", "mirostat_tau",
                 "mirostat_eta", "num_predict", "num_ctx", "stop", "num_keep", "repeat_last_n",
                 "num_gpu", "unknown_option"]  # fmt: skip
ODD_OLLAMA: list[tuple[str, Any]] = [
    ("context", [1, 2, 99999]), ("context", [-1]), ("context", "1 2"), ("context", [1.5]),
    ("keep_alive", "5m"), ("keep_alive", -1), ("keep_alive", [1]), ("keep_alive", True),
    ("think", True), ("think", "high"), ("think", 5), ("images", ["AAAA"]), ("raw", "yes"),
    ("raw", True), ("system", 5), ("template", "{{ .Prompt }}"), ("suffix", "x"),
    ("stream", "yes"), ("format", 5), ("options", [1]), ("options", "x"),
]  # fmt: skip


ODD_EMBED: list[tuple[str, Any]] = [
    ("truncate", "no"), ("truncate", False), ("truncate", 1), ("dimensions", 0),
    ("dimensions", -1), ("dimensions", 1.5), ("dimensions", 2**40), ("dimensions", True),
    ("dimensions", 1), ("input", []), ("input", [""]), ("input", ["x"] * 300), ("input", 5),
    ("input", [["x"]]), ("options", [1]), ("keep_alive", [1]),
]  # fmt: skip


def numbers(route: Route, rng: random.Random, mutate: Any) -> Request:
    if route.name == "ollama-embed" and route.body is not None:
        body = copy.deepcopy(route.body)
        for _ in range(rng.randint(1, 3)):
            key, value = rng.choice(ODD_EMBED)
            body[key] = copy.deepcopy(value)
        return _request(route, body)
    if route.api == "ollama":
        if route.name not in OLLAMA_GENERATING:
            route = rng.choice([r for r in ROUTES if r.name in OLLAMA_GENERATING])
        body = copy.deepcopy(route.body or {})
        options = body["options"]
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.3:
                key, value = rng.choice(ODD_OLLAMA)
                body[key] = copy.deepcopy(value)
            else:
                options[rng.choice(OLLAMA_FIELDS)] = rng.choice(
                    [*ODD_NUMBERS, -2, 2048, 4096, ["x"] * 17, "stop", [""]]
                )
        return _request(route, body)
    if route.body is None or route.name not in GENERATING:
        route = rng.choice([r for r in ROUTES if r.name in GENERATING])
    body = copy.deepcopy(route.body or {})
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.3:
            body["logit_bias"] = copy.deepcopy(rng.choice(ODD_BIASES))
        else:
            body[rng.choice(NUMBER_FIELDS)] = rng.choice(ODD_NUMBERS)
    if rng.random() < 0.2:
        body["stop"] = ["x"] * rng.choice([1, 16, 17, 1000])
    return _request(route, body)


def prompts(route: Route, rng: random.Random, mutate: Any) -> Request:
    if route.body is None or route.name not in GENERATING | OLLAMA_GENERATING | {
        "anthropic-count-tokens",
        "ollama-embed",
    }:
        route = rng.choice([r for r in ROUTES if r.name in GENERATING | OLLAMA_GENERATING])
    text = rng.choice([
        "w" * rng.choice([1000, 100_000, 400_000, 900_000]),
        "".join(chr(rng.choice([0x41, 0xE9, 0x4E2D, 0x1F600, 0x10FFFD, 0x7F, 0x0]))
                for _ in range(rng.choice([10, 5000]))),
        "", " ", "\u2028" * 100, "<|im_end|><s></s>[INST]" * 50,
    ])  # fmt: skip
    body = copy.deepcopy(route.body or {})
    if route.name == "ollama-embed":
        body["input"] = rng.choice([text, [text, "x"], [text] * 3])
        body["truncate"] = rng.choice([True, False])
    elif "input" in body:
        body["input"] = rng.choice([text, [{"type": "message", "role": "user", "content": text}]])
    elif "prompt" in body:
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
        if rng.random() < 0.3 and route.api == "anthropic":
            body["system"] = [{"type": "text", "text": text}]
    return _request(route, body)


def http_oddities(route: Route, rng: random.Random, mutate: Any) -> Request:
    kind = rng.choice(["not-json", "type", "length", "method", "path", "empty", "big-length"])
    body = json.dumps(route.body or {}).encode()
    if kind == "not-json":
        return _request(route, rng.choice([b"{", b"[1]", b"\xff\xfe", b"{'a': 1}", b"nul"]),
                        method="POST" if route.body else route.method)  # fmt: skip
    if kind == "type":
        kind_header = rng.choice(["text/plain", "application/x-www-form-urlencoded", "", "json"])
        return _request(route, body, headers={"content-type": kind_header}, method="POST")
    if kind == "length":
        value = rng.choice(["2x", "-1", " ", "1 2", "0x10", "+5", "1e3"])
        return _request(route, body, headers={"content-length": value}, method="POST")
    if kind == "big-length":
        return _request(route, body, headers={"content-length": str(10**12)}, method="POST")
    if kind == "method":
        return _request(route, body, method=rng.choice(["PUT", "DELETE", "PATCH", "GET", "HEAD"]))
    if kind == "path":
        extra = rng.choice(["/batches", "/x", "/../models", "%00", "/", "?stream=true"])
        return _request(route, body, path=route.path + extra)
    return _request(route, b"", method="POST")


FAMILIES: dict[str, Callable[[Route, random.Random, Any], Request]] = {
    "mutated": mutated,
    "schemas": schemas,
    "grammars": grammars,
    "numbers": numbers,
    "prompts": prompts,
    "http": http_oddities,
}


# ---------------------------------------------------------------- sending and judging
def send(base: str, req: Request) -> tuple[int | None, dict[str, str], bytes, str | None]:
    """(status, headers, body, why it failed to get an answer)."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=REQUEST_SECONDS)
    try:
        headers = dict(req.headers)
        if req.body is None:
            headers.pop("content-type", None)
        conn.putrequest(req.method, req.path, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        if req.body is not None and "content-length" not in {k.lower() for k in headers}:
            conn.putheader("content-length", str(len(req.body)))
        conn.endheaders(req.body)
        r = conn.getresponse()
        data = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, data, None
    except (OSError, http.client.HTTPException) as e:
        return None, {}, b"", f"no answer: {type(e).__name__}: {e}"
    finally:
        conn.close()


def verdict(
    req: Request, status: int | None, headers: dict[str, str], body: bytes, secret: str = ""
) -> str | None:
    """Why an answer breaks the contract (module docstring), or None; ``secret``: a server
    path no answer may hold (the model's folder)."""
    text = body.decode("utf-8", errors="replace")
    for leak in (*LEAKS, *([secret] if secret else [])):
        if leak in text:
            return f"the answer holds {leak!r}: {text[:300]}"
    if status is None:
        return "no answer"
    if status >= 500:
        return f"{status}: {text[:300]}"
    api = "anthropic" if req.path.startswith("/v1/messages") else "openai"
    if req.path.startswith("/api/"):
        api = "ollama"
    if req.method == "HEAD":  # an answer to HEAD has no body, whatever its type says
        return None
    if status >= 400:
        try:
            data = json.loads(body)
        except ValueError:
            return f"a {status} that is not JSON: {text[:200]}"
        return _shape(api, data, status)
    kind = headers.get("content-type", "")
    if kind.startswith("application/x-ndjson"):
        return _lines(text, req.max_tokens)
    if kind.startswith("text/event-stream") and req.path.startswith("/v1/responses"):
        return _response_events(text, req.max_tokens)
    if kind.startswith("text/event-stream"):
        return _stream(api, text, req.max_tokens)
    if kind.startswith("application/json"):
        try:
            data = json.loads(body)
        except ValueError:
            return f"a {status} that is not JSON: {text[:200]}"
        return _tokens(data, req.max_tokens)
    return None  # a page, /metrics


def _shape(api: str, data: Any, status: int) -> str | None:
    if api == "ollama":
        if (
            not isinstance(data, dict)
            or set(data) != {"error"}
            or not isinstance(data["error"], str)
        ):
            return f"a {status} not in Ollama's shape: {json.dumps(data)[:200]}"
        return None
    if api == "openai":
        error = data.get("error") if isinstance(data, dict) and len(data) == 1 else None
        if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
            return f"a {status} not in OpenAI's shape: {json.dumps(data)[:200]}"
        return None
    error = data.get("error") if isinstance(data, dict) and data.get("type") == "error" else None
    if not isinstance(error, dict) or set(error) != {"type", "message"}:
        return f"a {status} not in Anthropic's shape: {json.dumps(data)[:200]}"
    return None


def _tokens(data: Any, max_tokens: int | None) -> str | None:
    if max_tokens is None or not isinstance(data, dict):
        return None
    usage = data.get("usage") or {}
    used = usage.get("completion_tokens", usage.get("output_tokens", data.get("eval_count")))
    if isinstance(used, int) and used > max_tokens:
        return f"{used} tokens sampled for max_tokens {max_tokens}"
    return None


def _response_events(text: str, max_tokens: int | None) -> str | None:
    """A Responses stream: numbered events ending ``response.completed``/``.incomplete`` (its
    usage within ``max_output_tokens``) or an ``error`` event in OpenAI's error object."""
    datas = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    events = []
    for d in datas:
        try:
            events.append(json.loads(d))
        except ValueError:
            return f"an event that is not JSON: {d[:100]!r}"
    if not events:
        return "an event stream with no event"
    numbers = [e.get("sequence_number") for e in events]
    if numbers != list(range(len(events))):
        return f"events numbered {numbers[:20]}"
    last = events[-1]
    if last.get("type") == "error":
        error = last.get("error")
        if not isinstance(error, dict) or not {"message", "type", "param", "code"} <= set(error):
            return f"an error event out of shape: {json.dumps(last)[:200]}"
        return None
    if last.get("type") not in ("response.completed", "response.incomplete"):
        return f"a response stream that ends in {last.get('type')!r}"
    return _tokens(last.get("response"), max_tokens)


def _lines(text: str, max_tokens: int | None) -> str | None:
    """Ollama's JSON lines: each an object, the last ``done: true`` (within ``num_predict``)
    or an error."""
    lines = [ln for ln in text.split("\n") if ln.strip()]
    if not lines:
        return "a stream of JSON lines with no line"
    objects = []
    for ln in lines:
        try:
            objects.append(json.loads(ln))
        except ValueError:
            return f"a line that is not JSON: {ln[:100]!r}"
    last = objects[-1]
    if not isinstance(last, dict):
        return f"a last line that is no object: {lines[-1][:100]!r}"
    if "error" in last:
        return _shape("ollama", last, 200)
    if last.get("done") is not True:
        return f"a stream that ends with done {last.get('done')!r}"
    return _tokens(last, max_tokens)


def _stream(api: str, text: str, max_tokens: int | None) -> str | None:
    datas = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    if not datas:
        return "an event stream with no event"
    if api == "openai":
        if datas[-1] == "[DONE]":
            return None
        try:
            last = json.loads(datas[-1])
        except ValueError:
            return f"an event stream that ends in {datas[-1][:100]!r}"
        if isinstance(last, dict) and "error" in last:
            return _shape("openai", last, 200)
        return "an event stream that does not end with [DONE] or an error"
    events = []
    for d in datas:
        try:
            events.append(json.loads(d))
        except ValueError:
            return f"an event that is not JSON: {d[:100]!r}"
    last = events[-1]
    if last.get("type") == "error":
        return _shape("anthropic", last, 200)
    if last.get("type") != "message_stop":
        return f"a message stream that ends in {last.get('type')!r}"
    for e in events:
        if e.get("type") == "message_delta" and max_tokens is not None:
            used = (e.get("usage") or {}).get("output_tokens", 0)
            if used > max_tokens:
                return f"{used} tokens sampled for max_tokens {max_tokens}"
    return None


# ---------------------------------------------------------------- the pass
class Server:
    """``moepack serve MODEL`` started for the pass (the harness's address-space cap applies)."""

    def __init__(self, model: Path, python: str) -> None:
        self.stderr: list[str] = []
        self.proc = subprocess.Popen(
            [python, "-m", "moepack", "serve", str(model), "--port", "0", "--threads", "1",
             "--ctx", "1024", "--max-body", "2M"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None and self.proc.stderr is not None
        line = self.proc.stdout.readline()
        if "http://" not in line:
            self.proc.kill()
            raise RuntimeError(f"moepack serve did not start: {line}{self.proc.stderr.read()}")
        self.base = "http://" + line.split("http://", 1)[1].split("/v1", 1)[0]
        self.worker = self.worker_pid()
        # one line per request on stderr: read as it comes, or the pipe fills and blocks it
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def worker_pid(self) -> int | None:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        pids = out.stdout.split()
        return int(pids[0]) if len(pids) == 1 else None

    def stop(self) -> tuple[int | None, str]:
        self.proc.terminate()
        try:
            code: int | None = self.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = None
        self._reader.join(timeout=60)
        return code, "".join(self.stderr)


def request_pass(model: Path, python: str, count: int, seed: int,
                 mutate: Mutate) -> dict[str, Any]:  # fmt: skip
    """``count`` requests (each family and route in turn, each case's own seed); returns the
    counts per route and family, and the failures."""
    server = Server(model, python)
    rng = random.Random(seed)
    per_route = {r.name: 0 for r in ROUTES}
    per_family = {f: 0 for f in FAMILIES}
    failures: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    names = list(FAMILIES)
    try:
        for i in range(count):
            case_seed = rng.randrange(1 << 32)
            case = random.Random(case_seed)
            family = names[i % len(names)]
            route = ROUTES[(i // len(names)) % len(ROUTES)]
            req = FAMILIES[family](route, case, mutate)
            status, headers, body, error = send(server.base, req)
            per_route[req.route.name] += 1
            per_family[family] += 1
            why = error or verdict(req, status, headers, body, str(model.parent))
            worker = server.worker_pid()
            if why is None and worker != server.worker:
                why = f"the worker {server.worker} is gone (now {worker})"
            if why is not None:
                failures.append({"target": f"request:{req.route.name}", "mutation": family,
                                 "seed": case_seed, "kind": "server", "why": why,
                                 "args": [req.method, req.path,
                                          (req.body or b"")[:400].decode("utf-8", "replace")]})  # fmt: skip
                server.worker = worker
        code, err = server.stop()
    except BaseException:
        server.proc.kill()
        raise
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if code != 143 or not lines or not lines[-1].startswith("moepack: stopped; "):
        failures.append({"target": "request:stop", "mutation": "sigterm", "seed": -1,
                         "kind": "server", "why": f"exit {code}: {lines[-3:]}", "args": []})  # fmt: skip
    died = [ln for ln in lines if "worker died" in ln]
    if died:
        failures.append({"target": "request:worker", "mutation": "any", "seed": -1,
                         "kind": "server", "why": "; ".join(died)[:1000], "args": []})  # fmt: skip
    return {
        "requests": count,
        "per_route": per_route,
        "per_family": per_family,
        "failures": failures,
        "seconds": round(time.perf_counter() - t0, 1),
    }
