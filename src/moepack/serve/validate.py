"""Every field of a request that reaches llama.cpp, checked before any of it does.

llama-cpp-python's server hands request fields to llama.cpp nearly as they come, and llama.cpp
trusts its caller: a grammar it cannot parse gives a NULL sampler that is then used
(SIGSEGV), a token id outside the vocabulary is looked up unchecked (``std::out_of_range``:
SIGABRT), a null penalty reaches a C ``float`` (a 500). So each route's body is checked here,
in the guard, against the model it will run on (``Vocabulary``) and the server's limits
(``Limits``):

- the request types of llama-cpp-python (its ``pydantic`` models) parse the body; a field
  given as null means its default (OpenAI's clients send nulls for fields left out);
- ``model``, when given, names the served model (404 ``model_not_found``);
- grammars — ``grammar``, and those the chat handler makes from a ``response_format`` schema
  or a chosen tool's parameters — are parsed by llama.cpp itself on the model's vocabulary
  (``Vocabulary.parses``), so one it refuses is a 400 and never reaches a sampler;
- token ids (``/extras/detokenize``, ``logit_bias`` keys) lie in the vocabulary;
- numbers lie where llama.cpp and the sampler take them (penalties, temperature, ``top_k``,
  ``seed`` as a C ``uint32``, ``n`` and ``best_of`` 1: the server makes one choice);
- a prompt whose size in bytes alone shows it is longer than ``max_prompt_tokens`` (at most
  ``longest_piece`` bytes a token) is 413 before it is tokenised; one within that bound is
  counted in tokens when it runs (``prompt_cap``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from .shapes import ApiProblem, Refused

INT32 = (1 << 31) - 1
MAX_STOPS = 16
MAX_LOGPROBS = 20
BIAS = 100.0


@dataclass(frozen=True)
class Vocabulary:
    """What the checks need of the served model: its vocabulary's size, the longest piece a
    token detokenises to (bytes), and llama.cpp's grammar parser on it."""

    n_vocab: int
    longest_piece: int
    parses: Callable[[str], bool]


@dataclass(frozen=True)
class Limits:
    """The server's limits: the context, and the most tokens a prompt may have."""

    n_ctx: int
    max_prompt_tokens: int
    logprobs: bool = True  # whether the model keeps every token's logits


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiProblem:
    return ApiProblem(400, message, param, code)


class BodyChecks:
    """The checks of each route's body (``Route.check``): ``(problem or None, body)``."""

    def __init__(self, vocab: Vocabulary, limits: Limits, models: Collection[str]) -> None:
        self.vocab = vocab
        self.limits = limits
        self.models = tuple(models)

    # -- routes ---------------------------------------------------------------------------

    def completion(self, data: Any) -> tuple[ApiProblem | None, Any]:
        from llama_cpp.server.types import CreateCompletionRequest

        problem, data, body = self._typed(data, CreateCompletionRequest)
        if problem is not None:
            return problem, data
        problem = self._sampling(body) or self._prompt_bytes(
            _texts(body.prompt, body.suffix), "prompt"
        )
        if problem is None and isinstance(body.prompt, list) and len(body.prompt) > 1:
            problem = _bad("this server takes one prompt per request", "prompt")
        if problem is None and body.logprobs is not None:
            problem = self._logprobs(body.logprobs, "logprobs")
        return problem, data

    def chat(self, data: Any) -> tuple[ApiProblem | None, Any]:
        from llama_cpp.server.types import CreateChatCompletionRequest

        problem, data, body = self._typed(data, CreateChatCompletionRequest)
        if problem is not None:
            return problem, data
        if not body.messages:
            return _bad("`messages` must hold at least one message", "messages"), data
        problem = self._sampling(body) or self._prompt_bytes(
            _contents(data["messages"]), "messages"
        )
        if problem is None and body.logprobs:
            problem = self._logprobs(1, "logprobs")
        if problem is None and body.top_logprobs is not None:
            problem = self._logprobs(body.top_logprobs, "top_logprobs")
        return problem or self._chat_grammars(data), data

    def tokenize(self, data: Any) -> tuple[ApiProblem | None, Any]:
        from llama_cpp.server.types import TokenizeInputRequest

        problem, data, body = self._typed(data, TokenizeInputRequest)
        if problem is None:
            problem = self._prompt_bytes([body.input], "input")
        return problem, data

    def detokenize(self, data: Any) -> tuple[ApiProblem | None, Any]:
        from llama_cpp.server.types import DetokenizeInputRequest

        problem, data, body = self._typed(data, DetokenizeInputRequest)
        if problem is not None:
            return problem, data
        if len(body.tokens) > self.limits.max_prompt_tokens:
            return self._too_many(len(body.tokens), "tokens"), data
        return self._token_ids(body.tokens, "tokens"), data

    # -- parts ----------------------------------------------------------------------------

    def _typed(self, data: Any, kind: type[BaseModel]) -> tuple[ApiProblem | None, Any, Any]:
        """The body parsed by its request type, nulls taken as defaults."""
        if not isinstance(data, dict):
            return _bad("the request body must be a JSON object"), data, None
        fields = kind.model_fields
        if any(
            v is None and k in fields and fields[k].default is not None for k, v in data.items()
        ):
            data = {
                k: v
                for k, v in data.items()
                if not (v is None and k in fields and fields[k].default is not None)
            }
        model = data.get("model")
        if model is not None and model not in self.models:
            names = ", ".join(f"`{m}`" for m in self.models)
            return (
                ApiProblem(
                    404,
                    f"The model `{model}` does not exist (this server serves {names})",
                    "model",
                    "model_not_found",
                ),
                data,
                None,
            )
        max_tokens = data.get("max_tokens")
        if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens < 0:
            return (
                _bad(
                    f"`max_tokens` must be 0 or more, got {max_tokens}",
                    "max_tokens",
                    "integer_below_min_value",
                ),
                data,
                None,
            )
        try:
            body = kind.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or None
            text = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
            return _bad(text, where, str(first.get("type"))), data, None
        return None, data, body

    def _sampling(self, body: Any) -> ApiProblem | None:
        """The numbers and the grammar the sampler is built from."""
        checks: list[tuple[str, Any, float, float]] = [
            ("temperature", body.temperature, 0.0, float("inf")),
            ("repeat_penalty", body.repeat_penalty, 0.0, float("inf")),
            ("mirostat_eta", body.mirostat_eta, 0.0, float("inf")),
            ("top_k", body.top_k, 0, INT32),
            ("min_tokens", body.min_tokens, 0, self.limits.n_ctx),
            ("max_tokens", body.max_tokens, 0, INT32),
            ("seed", body.seed, 0, (1 << 32) - 1),
            ("n", body.n, 1, 1),
            ("best_of", getattr(body, "best_of", 1), 1, 1),
        ]
        for name, value, low, high in checks:
            if value is not None and not low <= value <= high:
                if low == high:
                    return _bad(
                        f"`{name}` must be {low}: this server makes one choice per request", name
                    )
                top = "" if high == float("inf") else f" and at most {high}"
                return _bad(f"`{name}` must be at least {low}{top}, got {value}", name)
        stop = body.stop
        if isinstance(stop, list) and len(stop) > MAX_STOPS:
            return _bad(f"`stop` holds {len(stop)} sequences; at most {MAX_STOPS}", "stop")
        problem = self._bias(body.logit_bias, body.logit_bias_type)
        if problem is None and body.grammar is not None:
            problem = self._grammar(body.grammar, "grammar")
        return problem

    def _bias(self, bias: dict[str, float] | None, kind: str | None) -> ApiProblem | None:
        if not bias:
            return None
        if len(bias) > self.vocab.n_vocab:
            return _bad(
                f"`logit_bias` has {len(bias)} entries, more than the vocabulary's "
                f"{self.vocab.n_vocab} tokens",
                "logit_bias",
            )
        for key, value in bias.items():
            if not -BIAS <= value <= BIAS:
                return _bad(
                    f"`logit_bias` values lie in [-{BIAS:g}, {BIAS:g}], got {value} for {key!r}",
                    "logit_bias",
                )
        if kind == "tokens":  # the keys are text, tokenised by the server
            return None
        ids: list[int] = []
        for key in bias:
            try:
                ids.append(int(key))
            except ValueError:
                return _bad(f"`logit_bias` keys are token ids, got {key[:40]!r}", "logit_bias")
        return self._token_ids(ids, "logit_bias")

    def _token_ids(self, ids: Iterable[int], param: str) -> ApiProblem | None:
        n = self.vocab.n_vocab
        for t in ids:
            if not 0 <= t < n:
                return _bad(
                    f"token id {t} is not in the vocabulary (0 to {n - 1})",
                    param,
                    "invalid_token_id",
                )
        return None

    def _grammar(self, grammar: str, param: str) -> ApiProblem | None:
        if not self.vocab.parses(grammar):
            return _bad(
                "llama.cpp cannot parse this grammar (GBNF, with a `root` rule)",
                param,
                "invalid_grammar",
            )
        return None

    def _chat_grammars(self, data: dict[str, Any]) -> ApiProblem | None:
        """The grammars the chat handler would make from a schema (it falls back to plain
        JSON where llama-cpp-python cannot convert one; what it converts llama.cpp parses)."""
        fmt = data.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_object" and "schema" in fmt:
            problem = self._schema(fmt["schema"], "response_format")
            if problem is not None:
                return problem
        choice, tools = data.get("tool_choice"), data.get("tools")
        if data.get("functions") and isinstance(data.get("function_call"), dict):
            choice = {"function": data["function_call"]}
            tools = [{"function": f} for f in data["functions"]]
        if isinstance(choice, dict) and tools is not None:
            name = (choice.get("function") or {}).get("name")
            tool = next((t for t in tools if (t.get("function") or {}).get("name") == name), None)
            if tool is None:
                return _bad(
                    f"`tool_choice` names {name!r}, which is not among `tools`", "tool_choice"
                )
            return self._schema(tool["function"].get("parameters"), "tools")
        return None

    def _schema(self, schema: Any, param: str) -> ApiProblem | None:
        import json

        from llama_cpp.llama_grammar import json_schema_to_gbnf

        try:
            grammar = json_schema_to_gbnf(json.dumps(schema))
        except Exception:  # the handler falls back to its JSON grammar, which parses
            return None
        return self._grammar(grammar, param)

    def _logprobs(self, count: int, param: str) -> ApiProblem | None:
        if not self.limits.logprobs:
            return _bad(
                "logprobs need the logits of every token, which this server keeps "
                "only while it traces (--trace-out)",
                "logprobs",
            )
        if not 0 <= count <= MAX_LOGPROBS:
            return _bad(f"`{param}` must be 0 to {MAX_LOGPROBS}, got {count}", param)
        return None

    def _prompt_bytes(self, texts: Iterable[str], param: str) -> ApiProblem | None:
        size = sum(len(t.encode("utf-8")) for t in texts)
        limit = self.limits.max_prompt_tokens
        if size > limit * self.vocab.longest_piece:
            return ApiProblem(
                413,
                f"the {param} is {size:,} bytes: more than {limit:,} tokens "
                f"of this vocabulary (at most {self.vocab.longest_piece} bytes a "
                "token), the most this server takes (--max-prompt-tokens)",
                param,
                "prompt_too_large",
            )
        return None

    def _too_many(self, n: int, param: str) -> ApiProblem:
        return ApiProblem(
            413,
            f"{n:,} tokens are more than the {self.limits.max_prompt_tokens:,} "
            "this server takes (--max-prompt-tokens)",
            param,
            "prompt_too_large",
        )


def prompt_cap(tokens: int, limits: Limits) -> None:
    """``Refused`` (413) for a prompt of ``tokens`` tokens over ``max_prompt_tokens`` (one
    that fills the context is llama-cpp-python's own 400 ``context_length_exceeded``)."""
    limit = limits.max_prompt_tokens
    if tokens > limit and limit < limits.n_ctx:
        raise Refused(
            ApiProblem(
                413,
                f"the prompt is {tokens:,} tokens; this server takes at "
                f"most {limit:,} (--max-prompt-tokens)",
                "prompt",
                "prompt_too_large",
            )
        )


def _texts(prompt: str | list[str], suffix: str | None) -> list[str]:
    texts = [prompt] if isinstance(prompt, str) else list(prompt)
    return texts + ([suffix] if suffix else [])


def _contents(messages: list[Any]) -> Iterable[str]:
    """The text of chat messages (their ``content``, a string or text parts): what the chat
    template renders at the least."""
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            yield from (
                p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            )


def vocabulary_of(llm: Any) -> Vocabulary:
    """The ``Vocabulary`` of a loaded ``Llama``: its size, its longest piece (every token's
    piece asked of llama.cpp once, specials included: a prompt is tokenised with them), and
    a grammar check by llama.cpp's own parser (a sampler made and freed)."""
    import ctypes

    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n = int(llama_cpp.llama_vocab_n_tokens(vocab))
    buf = ctypes.create_string_buffer(256)
    longest = max(
        (
            abs(int(llama_cpp.llama_token_to_piece(vocab, i, buf, len(buf), 0, True)))
            for i in range(n)
        ),
        default=1,
    )

    def parses(grammar: str) -> bool:
        sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode("utf-8"), b"root")
        if not sampler:
            return False
        llama_cpp.llama_sampler_free(sampler)
        return True

    return Vocabulary(n_vocab=n, longest_piece=max(1, longest), parses=parses)
