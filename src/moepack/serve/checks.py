"""What a request may ask of llama.cpp, checked the same way whatever API it came through.

Each API reads its own request shape (``validate`` OpenAI's, ``anthropic_request``
Anthropic's); what the request then hands llama.cpp is the same: a sampler's numbers, token
ids, grammars (given, or made from a JSON schema), a prompt. llama.cpp trusts its caller with
all of them, so every API calls these checks before the model sees anything, and an API added
later calls them too. Each returns an ``ApiProblem`` (None: fine), the field named as the
calling API names it (``param``).

- **Grammars** (``RequestChecks.grammar``): llama.cpp's parser returns a NULL sampler for a
  grammar it refuses (a quote inside a literal, an empty rule, an escape it has not, left
  recursion such as ``x ::= x``), and llama-cpp-python adds it to its sampler chain
  unchecked: SIGSEGV at the first token. A grammar it takes can still leave no token to
  sample — a character no token holds (U+0000: llama.cpp skips every piece that starts with
  a zero byte), a token id past the vocabulary, the end-of-text token as a grammar token —
  and its sampler then throws through C (SIGABRT). Its parser also recurses once per nesting
  level (about 20,000 levels overflow the stack of the thread parsing it) and takes time
  growing faster than the grammar's length. So a grammar is held to ``MAX_GRAMMAR_BYTES`` and
  ``MAX_GRAMMAR_NESTING``, parsed by llama.cpp on the model's vocabulary, and must allow some
  token at its start (``Vocabulary.grammar``); one that runs out of tokens later is stopped
  before the sample that would crash (``llamagrammar.guard_samplers``).
- **Schemas** (``RequestChecks.schema``) become grammars by llama-cpp-python's converter (as
  mended by ``schema_grammar``), whose output grows with every ``minItems``, ``maxLength``
  and pattern count (``{m,n}``) in them: their sum is held to ``MAX_REPEATS`` before it runs.
  A schema it cannot convert is no problem: the chat handlers then use its JSON grammar.
- **Numbers** (``RequestChecks.numbers``): each sampling field llama-cpp-python passes to C
  lies where the sampler takes it and is a JSON number (``seed`` a C ``uint32``, ``top_k`` an
  ``int32``, probabilities in [0, 1], …); an integer field takes a float only with no
  fraction, as pydantic does, and is passed on as an int (``sampling_value``).
- **Token ids** (``logit_bias`` keys, ``/extras/detokenize``) lie in the vocabulary (llama.cpp
  looks them up unchecked: ``std::out_of_range``, SIGABRT).
- **Prompts** whose size in bytes alone shows them longer than ``max_prompt_tokens`` (at most
  ``longest_piece`` bytes a token) are 413 before they are tokenised, which takes time
  growing as the square of one long word's length.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .shapes import ApiProblem, Refused

INT32 = (1 << 31) - 1
UINT32 = (1 << 32) - 1
BIAS = 100.0
MAX_GRAMMAR_BYTES = 64 << 10
MAX_GRAMMAR_NESTING = 2000
MAX_REPEATS = 10_000
REPEAT_KEYS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")
_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_TOKEN_ID = re.compile(r"-?\d{1,12}")  # longer is no token id (nor text int() reads)
_SKIPPED = re.compile(r'"(?:\\.|[^"\\])*"?|\[(?:\\.|[^\]\\])*\]?|#[^\r\n]*')
"""A GBNF literal, character class or comment: no parenthesis in them nests."""


@dataclass(frozen=True)
class Vocabulary:
    """What the checks need of the served model: its vocabulary's size, the longest piece a
    token detokenises to (bytes), and llama.cpp's verdict on a grammar (None: it takes it;
    else why not)."""

    n_vocab: int
    longest_piece: int
    grammar: Callable[[str], str | None]


@dataclass(frozen=True)
class Limits:
    """The server's limits: the context, and the most tokens a prompt may have."""

    n_ctx: int
    max_prompt_tokens: int
    logprobs: bool = True  # whether the model keeps every token's logits


@dataclass(frozen=True)
class Number:
    """Where a sampling field lies (inclusive), and whether it is an integer."""

    low: float
    high: float
    integer: bool = False


SAMPLING: dict[str, Number] = {
    "temperature": Number(0.0, math.inf),
    "top_p": Number(0.0, 1.0),
    "min_p": Number(0.0, 1.0),
    "typical_p": Number(0.0, 1.0),
    "top_k": Number(0, INT32, integer=True),
    "repeat_penalty": Number(0.0, math.inf),
    "presence_penalty": Number(-2.0, 2.0),
    "frequency_penalty": Number(-2.0, 2.0),
    "mirostat_mode": Number(0, 2, integer=True),
    "mirostat_tau": Number(0.0, 10.0),
    "mirostat_eta": Number(0.0, 1.0),
    "seed": Number(0, UINT32, integer=True),
    "max_tokens": Number(0, INT32, integer=True),
}
"""The sampling fields of llama-cpp-python's requests that reach C, by the name both APIs use."""


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiProblem:
    return ApiProblem(400, message, param, code)


def token_budget(data: Any) -> int | None:
    """The most tokens a request's generations may sample together: its ``max_tokens`` (both
    APIs' name; None, 0 or absent: up to the end of the context)."""
    value = data.get("max_tokens") if isinstance(data, dict) else None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


class RequestChecks:
    """The checks (see the module docstring) against one model and one server's limits."""

    def __init__(self, vocab: Vocabulary, limits: Limits) -> None:
        self.vocab = vocab
        self.limits = limits

    # -- numbers ------------------------------------------------------------------------------

    def numbers(self, fields: Mapping[str, Any]) -> ApiProblem | None:
        """The sampling fields among ``fields`` (raw JSON values; None: the default)."""
        for name, value in fields.items():
            kind = SAMPLING.get(name)
            if kind is not None and value is not None:
                problem = _number(name, value, kind)
                if problem is not None:
                    return problem
        return None

    def logit_bias(
        self, bias: Any, by_text: bool = False, param: str = "logit_bias"
    ) -> ApiProblem | None:
        """``logit_bias``: an object of token ids (``by_text``: texts the server tokenises)
        to numbers in [-100, 100]."""
        if bias is None:
            return None
        if not isinstance(bias, dict):
            return bad(f"`{param}` must be an object of token ids to numbers", param)
        if len(bias) > self.vocab.n_vocab:
            return bad(
                f"`{param}` has {len(bias)} entries, more than the vocabulary's "
                f"{self.vocab.n_vocab} tokens",
                param,
            )
        for key, value in bias.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                return bad(f"`{param}` values are numbers, got {value!r} for {key[:40]!r}", param)
            if not -BIAS <= value <= BIAS:
                return bad(
                    f"`{param}` values lie in [-{BIAS:g}, {BIAS:g}], got {value} for {key[:40]!r}",
                    param,
                )
        if by_text:
            return None
        ids: list[int] = []
        for key in bias:
            if not _TOKEN_ID.fullmatch(key):
                return bad(f"`{param}` keys are token ids, got {key[:40]!r}", param)
            ids.append(int(key))
        return self.token_ids(ids, param)

    def token_ids(self, ids: Iterable[int], param: str) -> ApiProblem | None:
        n = self.vocab.n_vocab
        for t in ids:
            if not 0 <= t < n:
                return bad(
                    f"`{param}`: token id {t} is not in the vocabulary (0 to {n - 1})",
                    param,
                    "invalid_token_id",
                )
        return None

    # -- grammars ------------------------------------------------------------------------------

    def grammar(self, text: str, param: str) -> ApiProblem | None:
        """A GBNF grammar the sampler would be built from."""
        size = len(text.encode("utf-8"))
        if size > MAX_GRAMMAR_BYTES:
            return _grammar(
                f"the grammar is {size:,} bytes; this server takes grammars of at most "
                f"{MAX_GRAMMAR_BYTES:,} (llama.cpp's parser slows down faster than they grow)",
                param,
            )
        depth = nesting(text)
        if depth > MAX_GRAMMAR_NESTING:
            return _grammar(
                f"the grammar nests {depth:,} groups deep; this server takes at most "
                f"{MAX_GRAMMAR_NESTING:,} (llama.cpp's parser recurses once a level)",
                param,
            )
        why = self.vocab.grammar(text)
        return None if why is None else _grammar(why, param)

    def schema(self, schema: Any, param: str) -> ApiProblem | None:
        """The grammar llama-cpp-python's chat handlers make of a JSON schema (a tool's
        parameters, a ``response_format``'s schema)."""
        from .schema_grammar import grammar_of

        repeats = repetitions(schema)
        if repeats > MAX_REPEATS:
            return _grammar(
                f"the schema asks for {repeats:,} repetitions in all (minItems, maxLength, "
                f"pattern counts, …); this server makes grammars of at most {MAX_REPEATS:,}",
                param,
            )
        try:
            text = grammar_of(schema)
        except Exception:  # the handlers then use llama-cpp-python's JSON grammar, which parses
            return None
        return self.grammar(text, param)

    def schemas(self, schemas: Iterable[tuple[str, Any]]) -> ApiProblem | None:
        """Each ``(param, schema)`` in turn (every tool a chat format may make a call of)."""
        for param, schema in schemas:
            problem = self.schema(schema, param)
            if problem is not None:
                return problem
        return None

    # -- prompts ------------------------------------------------------------------------------

    def prompt_bytes(self, texts: Iterable[str], param: str) -> ApiProblem | None:
        """413 for a prompt whose bytes alone show it longer than ``max_prompt_tokens``."""
        size = sum(len(t.encode("utf-8", errors="replace")) for t in texts)
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

    def too_many(self, n: int, param: str) -> ApiProblem:
        return ApiProblem(
            413,
            f"{n:,} tokens are more than the {self.limits.max_prompt_tokens:,} "
            "this server takes (--max-prompt-tokens)",
            param,
            "prompt_too_large",
        )


def sampling_value(name: str, value: Any) -> Any:
    """A checked sampling field as llama-cpp-python must get it: an integer field's whole
    float (``5.0``, ``-0.0``) as an int — ctypes refuses a float for a C integer (a 500), and
    pydantic converts it alike on the OpenAI routes."""
    kind = SAMPLING.get(name)
    if kind is not None and kind.integer and isinstance(value, float):
        return int(value)
    return value


def sampling_values(fields: Mapping[str, Any]) -> dict[str, Any]:
    """``sampling_value`` of each of ``fields``."""
    return {name: sampling_value(name, value) for name, value in fields.items()}


def message_texts(messages: Iterable[Any]) -> Iterator[str]:
    """The text of OpenAI-form chat messages (their ``content``, a string or text parts): what
    a chat template renders of them at the least."""
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            yield from (
                p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
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


def _grammar(message: str, param: str) -> ApiProblem:
    return bad(message, param, "invalid_grammar")


def _number(name: str, value: Any, kind: Number) -> ApiProblem | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        what = "an integer" if kind.integer else "a number"
        return bad(f"`{name}` must be {what}, got {json_text(value)}", name)
    if kind.integer and isinstance(value, float) and not value.is_integer():
        return bad(f"`{name}` must be an integer, got {value}", name)
    if not kind.low <= value <= kind.high:
        low = f"{kind.low:,}" if kind.integer else f"{kind.low:g}"
        if kind.high == math.inf:
            where = f"at least {low}"
        else:
            where = f"{low} to {kind.high:,}" if kind.integer else f"{low} to {kind.high:g}"
        return bad(f"`{name}` must be {where}, got {json_text(value)}", name)
    return None


def json_text(value: Any, limit: int = 40) -> str:
    import json

    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _count(digits: str) -> int:
    """A pattern's ``{m,n}`` count (one too long to be read is larger than any cap)."""
    return int(digits) if 0 < len(digits) <= 12 else (0 if not digits else 1 << 62)


def nesting(grammar: str) -> int:
    """How deep a GBNF grammar's parentheses nest (outside its literals, character classes
    and comments): the depth llama.cpp's parser recurses to."""
    import numpy as np

    kept = np.frombuffer(_SKIPPED.sub(" ", grammar).encode("utf-8"), np.uint8)
    steps = (kept == ord("(")).astype(np.int64) - (kept == ord(")"))
    return int(np.cumsum(steps).max(initial=0))


def repetitions(schema: Any) -> int:
    """The repetition counts a JSON schema asks of its grammar, summed: every ``minItems``,
    ``maxItems``, ``minLength``, ``maxLength``, ``minProperties``, ``maxProperties`` and
    every ``{m}``/``{m,n}`` of a ``pattern``, wherever they sit (each adds about its count of
    rules or literals to what llama-cpp-python's converter writes)."""
    total = 0
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in REPEAT_KEYS and isinstance(value, int | float) and value > 0:
                    total += int(min(value, 1 << 62))
                elif key == "pattern" and isinstance(value, str):
                    for low, high in _COUNT.findall(value):
                        total += max(_count(low), _count(high))
                else:
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)
    return total
