"""The body of each OpenAI route, read by llama-cpp-python's own request types and checked before
any of it reaches llama.cpp.

The request types of llama-cpp-python (its ``pydantic`` models) parse the body; a field given
as null means its default (OpenAI's clients send nulls for fields left out); ``model``, when
given, names the served model (404 ``model_not_found``), and when not it is set to it
(llama-cpp-python would answer with the path of the model's file). What the request then asks
of llama.cpp is checked by ``checks`` (the checks every API of the server makes): its
sampling numbers (each a JSON number as given, before pydantic would read ``"5"`` or ``true``
as one), ``logit_bias``, token ids (``/extras/detokenize``), its grammar, the grammars the
chat handler makes from a ``response_format`` schema and from every tool it may call, and its
prompt's size. OpenAI's own: ``n`` and ``best_of`` are 1 (the server makes one choice), at
most 16 ``stop`` sequences, ``logprobs`` only from a server that keeps every token's logits;
``tool_choice: "required"`` is a call of the one tool given (no chat format of
llama-cpp-python has "some tool"), refused with several; ``reasoning_effort`` (but ``none``)
is refused, as OpenAI refuses it for a model that does not reason.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from .checks import Limits, RequestChecks, Vocabulary, bad, message_texts
from .names import ModelNames
from .shapes import ApiProblem

MAX_STOPS = 16
MAX_LOGPROBS = 20


class BodyChecks:
    """The checks of each route's body (``Route.check``): ``(problem or None, body)``."""

    def __init__(self, vocab: Vocabulary, limits: Limits, names: ModelNames) -> None:
        self.checks = RequestChecks(vocab, limits)
        self.limits = limits
        self.names = names

    # -- routes ---------------------------------------------------------------------------

    def completion(self, data: Any) -> tuple[ApiProblem | None, Any]:
        from llama_cpp.server.types import CreateCompletionRequest

        problem, data, body = self._typed(data, CreateCompletionRequest)
        if problem is not None:
            return problem, data
        problem = self._sampling(body) or self.checks.prompt_bytes(
            _texts(body.prompt, body.suffix), "prompt"
        )
        if problem is None and isinstance(body.prompt, list) and len(body.prompt) > 1:
            problem = bad("this server takes one prompt per request", "prompt")
        if problem is None and body.logprobs is not None:
            problem = self._logprobs(body.logprobs, "logprobs")
        return problem, data

    def chat(self, data: Any) -> tuple[ApiProblem | None, Any]:
        from llama_cpp.server.types import CreateChatCompletionRequest

        problem, data, body = self._typed(data, CreateChatCompletionRequest)
        if problem is not None:
            return problem, data
        if not body.messages:
            return bad("`messages` must hold at least one message", "messages"), data
        problem = _text_only(data["messages"]) or _no_reasoning(data)
        if problem is not None:
            return problem, data
        problem = self._sampling(body) or self.checks.prompt_bytes(
            message_texts(data["messages"]), "messages"
        )
        if problem is None and body.logprobs:
            problem = self._logprobs(1, "logprobs")
        if problem is None and body.top_logprobs is not None:
            problem = self._logprobs(body.top_logprobs, "top_logprobs")
        if problem is None:
            problem, data = _required(data)
        return problem or self._chat_grammars(data), data

    def tokenize(self, data: Any) -> tuple[ApiProblem | None, Any]:
        from llama_cpp.server.types import TokenizeInputRequest

        problem, data, body = self._typed(data, TokenizeInputRequest, model_required=False)
        if problem is None:
            problem = self.checks.prompt_bytes([body.input], "input")
        return problem, data

    def detokenize(self, data: Any) -> tuple[ApiProblem | None, Any]:
        from llama_cpp.server.types import DetokenizeInputRequest

        problem, data, body = self._typed(data, DetokenizeInputRequest, model_required=False)
        if problem is not None:
            return problem, data
        if len(body.tokens) > self.limits.max_prompt_tokens:
            return self.checks.too_many(len(body.tokens), "tokens"), data
        return self.checks.token_ids(body.tokens, "tokens"), data

    # -- parts ----------------------------------------------------------------------------

    def _typed(
        self, data: Any, kind: type[BaseModel], model_required: bool = True
    ) -> tuple[ApiProblem | None, Any, Any]:
        """The body parsed by its request type, nulls taken as defaults (``model`` required of
        completions, as OpenAI requires it)."""
        if not isinstance(data, dict):
            return bad("the request body must be a JSON object"), data, None
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
        if model is None and model_required:
            return bad("model: Field required", "model", "missing"), data, None
        if isinstance(model, str) and not self.names.matches(model):
            return (
                ApiProblem(404, self.names.unknown(model), "model", "model_not_found"),
                data,
                None,
            )
        max_tokens = data.get("max_tokens")
        if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens < 0:
            return (
                bad(
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
            return bad(text, where, str(first.get("type"))), data, None
        problem = self.checks.numbers(data)  # as given: pydantic read "5" or true as numbers
        return problem, data, (body if problem is None else None)

    def _sampling(self, body: Any) -> ApiProblem | None:
        """What the sampler is built from beyond the numbers ``_typed`` checked: OpenAI's
        one-choice fields, ``min_tokens`` within the context, the ``stop`` list,
        ``logit_bias`` and the grammar."""
        for name in ("n", "best_of"):
            value = getattr(body, name, 1)
            if value is not None and value != 1:
                return bad(f"`{name}` must be 1: this server makes one choice per request", name)
        if body.min_tokens is not None and not 0 <= body.min_tokens <= self.limits.n_ctx:
            return bad(
                f"`min_tokens` must be 0 to the context ({self.limits.n_ctx}), got "
                f"{body.min_tokens}",
                "min_tokens",
            )
        stop = body.stop
        if isinstance(stop, list) and len(stop) > MAX_STOPS:
            return bad(f"`stop` holds {len(stop)} sequences; at most {MAX_STOPS}", "stop")
        problem = self.checks.logit_bias(body.logit_bias, by_text=body.logit_bias_type == "tokens")
        if problem is None and body.grammar is not None:
            problem = self.checks.grammar(body.grammar, "grammar")
        return problem

    def _chat_grammars(self, data: dict[str, Any]) -> ApiProblem | None:
        """The grammars the chat handler may make from a schema: a ``response_format``'s, and
        every tool's parameters (all of them unless ``tool_choice`` is "none": a chat format
        that chooses may call any; a named one must be among them)."""
        fmt = data.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_object" and "schema" in fmt:
            problem = self.checks.schema(fmt["schema"], "response_format")
            if problem is not None:
                return problem
        choice, tools = data.get("tool_choice"), list(data.get("tools") or [])
        if data.get("functions"):
            if isinstance(data.get("function_call"), dict) or choice is None:
                choice = data.get("function_call")
            tools += [{"function": f} for f in data["functions"]]
        if not tools or choice == "none":
            return None
        if isinstance(choice, dict):
            name = (choice.get("function") or choice).get("name")
            if name not in [(t.get("function") or {}).get("name") for t in tools]:
                return bad(
                    f"`tool_choice` names {name!r}, which is not among `tools`", "tool_choice"
                )
        return self.checks.schemas(
            ("tools", (t.get("function") or {}).get("parameters")) for t in tools
        )

    def _logprobs(self, count: int, param: str) -> ApiProblem | None:
        if not self.limits.logprobs:
            return bad(
                "logprobs need the logits of every token, which this server keeps "
                "only while it traces (--trace-out)",
                "logprobs",
            )
        if not 0 <= count <= MAX_LOGPROBS:
            return bad(f"`{param}` must be 0 to {MAX_LOGPROBS}, got {count}", param)
        return None


TEXT_PARTS = ("text",)


def _text_only(messages: Any) -> ApiProblem | None:
    """A content part that is not text (an image, audio, a file): the model takes text, and
    llama-cpp-python's chat formats would drop the part without a word."""
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        content = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in TEXT_PARTS:
                where = f"messages.[{i}].content.[{j}].type"
                return bad(
                    f"Invalid content type. {kind} is not supported by this model: it takes "
                    "text (llama.cpp serves no image, audio or file input here)",
                    where,
                    "unsupported_content_type",
                )
    return None


def _no_reasoning(data: dict[str, Any]) -> ApiProblem | None:
    """``reasoning_effort`` (but ``none``) or a ``reasoning`` summary: OpenAI's 400 for a model
    that does not reason, rather than an answer without the reasoning asked for."""
    effort, reasoning = data.get("reasoning_effort"), data.get("reasoning")
    if effort not in (None, "none"):
        param = "reasoning_effort"
    elif isinstance(reasoning, dict) and any(
        v is not None and (k, v) != ("effort", "none") for k, v in reasoning.items()
    ):
        param = "reasoning"
    else:
        return None
    return bad(
        f"Unsupported parameter: '{param}' is not supported with this model (it does not "
        "reason: no effort, no summary).",
        param,
        "unsupported_parameter",
    )


def _required(data: dict[str, Any]) -> tuple[ApiProblem | None, dict[str, Any]]:
    """``tool_choice: "required"`` as a call of the one tool given (``chatml-function-calling``
    failed on it; the other formats answered with a message, as for "auto")."""
    if data.get("tool_choice") != "required":
        return None, data
    tools = data.get("tools") or []
    if len(tools) != 1:
        said = "no tools" if not tools else f"{len(tools)} tools"
        return bad(
            f'`tool_choice` "required" with {said}: this server makes a call of one tool '
            '(llama-cpp-python\'s chat formats have no "some tool"); give one tool, or name '
            "one",
            "tool_choice",
        ), data
    name = (tools[0].get("function") or {}).get("name")
    return None, {**data, "tool_choice": {"type": "function", "function": {"name": name}}}


def _texts(prompt: str | list[str], suffix: str | None) -> list[str]:
    texts = [prompt] if isinstance(prompt, str) else list(prompt)
    return texts + ([suffix] if suffix else [])
