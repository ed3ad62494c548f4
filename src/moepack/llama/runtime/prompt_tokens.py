"""Prompts to token ids inside a llama.cpp child: plain text, or chat messages through the
model's own chat template (``--chat`` wraps a plain prompt as one user message). Capture and
run tokenize the same way, so one workload routes the same in both."""

from __future__ import annotations

from typing import Any, cast

from ...errors import BadInput
from .session import LlamaSession


class InputError(BadInput):
    """A prompt or setting llama.cpp cannot take (the worker reports it as bad input)."""


def chat_text(session: LlamaSession, messages: list[dict[str, str]]) -> tuple[str, bool]:
    """``messages`` through the model's own chat template; (text, template added specials)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    meta = session.metadata()
    template = meta.get("tokenizer.chat_template")
    if not template:
        raise InputError("the model has no chat template (tokenizer.chat_template)")

    def piece(key: str) -> str:
        tid = meta.get(key)
        return session.token_text(int(tid)) if tid is not None else ""

    fmt = Jinja2ChatFormatter(
        template=template,
        eos_token=piece("tokenizer.ggml.eos_token_id"),
        bos_token=piece("tokenizer.ggml.bos_token_id"),
    )
    try:
        res = fmt(messages=cast(Any, messages))
    except Exception as e:  # a template error is the template's, with its own message
        raise InputError(f"the chat template failed: {e}") from None
    return res.prompt, bool(getattr(res, "added_special", False))


def tokenize_prompts(session: LlamaSession, job: dict[str, Any], limit: int) -> list[list[int]]:
    """Every prompt's tokens; ``InputError`` for an empty one or one (plus the tokens to
    generate) longer than ``limit``, the context (0: no limit known)."""
    out: list[list[int]] = []
    for i, p in enumerate(job["prompts"]):
        messages = p.get("messages")
        if messages is None and job["chat"]:
            messages = [{"role": "user", "content": p["prompt"]}]
        if messages is not None:
            text, added = chat_text(session, messages)
            toks = session.tokenize(text, add_special=not added)
        else:
            toks = session.tokenize(p["prompt"])
        if not toks:
            raise InputError(f"prompt {i + 1} is empty")
        need = len(toks) + job["n_predict"]
        if limit and need > limit:
            raise InputError(
                f"prompt {i + 1} has {len(toks)} tokens"
                + (f" + {job['n_predict']} to generate" if job["n_predict"] else "")
                + f", longer than the context of {limit} tokens"
            )
        out.append(toks)
    return out
