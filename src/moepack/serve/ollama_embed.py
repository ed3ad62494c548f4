"""Ollama's embedding requests: ``/api/embed`` and the older ``/api/embeddings``, read and
answered (the vectors are ``embedding.Embedder``'s).

``/api/embed`` takes ``input``, a text or a list of texts, and answers ``embeddings``, one
vector of length 1 a text, with ``prompt_eval_count`` (the tokens embedded) and the timings
in nanoseconds; ``truncate`` (default true) cuts a text longer than the served context to it,
false refuses it (400); ``dimensions`` keeps the first N numbers of each vector, scaled to
length 1 again. ``/api/embeddings`` takes one ``prompt`` and answers ``embedding``, the vector
as the model gives it (not scaled; an empty prompt, an empty vector), as Ollama does.
``options`` and ``keep_alive`` are accepted and change nothing (the model is loaded once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .checks import RequestChecks, json_text
from .embedding import Embedded, normalized
from .names import ModelNames
from .ollama_request import OllamaError, bad, keep_alive, model_of

EMBED = "/api/embed"
LEGACY = "/api/embeddings"


@dataclass(frozen=True)
class EmbedCall:
    """What an embedding request asks for (``legacy``: ``/api/embeddings``)."""

    model: str
    texts: list[str]
    legacy: bool
    truncate: bool = True
    dimensions: int | None = None


def read_embed(data: Any, names: ModelNames, legacy: bool, checks: RequestChecks) -> EmbedCall:
    """The call a body asks for, every part checked (``OllamaError`` if not)."""
    model = model_of(data, names)
    keep_alive(data.get("keep_alive"))
    options = data.get("options")
    if options is not None and not isinstance(options, dict):
        raise bad(f"options must be an object, got {json_text(options)}")
    if legacy:
        prompt = data.get("prompt", "")
        if not isinstance(prompt, str):
            raise bad(f"prompt must be a string, got {json_text(prompt)}")
        texts = [prompt] if prompt else []  # Ollama answers an empty prompt an empty vector
    else:
        value = data.get("input")
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise bad(f"input must be a string or a list of strings, got {json_text(value)}")
    truncate = data.get("truncate", True)
    if not isinstance(truncate, bool):
        raise bad(f"truncate must be true or false, got {json_text(truncate)}")
    dimensions = data.get("dimensions")
    if dimensions is not None and (
        isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1
    ):
        raise bad(f"dimensions must be a positive integer, got {json_text(dimensions)}")
    problem = checks.prompt_bytes(texts, "input")
    if problem is not None:
        raise OllamaError(problem.status, problem.message)
    return EmbedCall(model, texts, legacy, truncate, dimensions)


def token_lists(call: EmbedCall, tokens: Any, limit: int) -> list[list[int]]:
    """Each text of ``call`` as tokens (``tokens(text)``), cut to ``limit`` where ``truncate``
    lets it be; 400 for a longer one otherwise, and for a text with no token at all."""
    out = []
    for i, text in enumerate(call.texts):
        ids = list(tokens(text))
        if len(ids) > limit:
            if not call.truncate:
                raise bad(
                    f"input {i} is {len(ids):,} tokens: more than the context's {limit:,} "
                    "(truncate: true cuts it to fit)"
                )
            ids = ids[:limit]
        if not ids:
            raise bad(f"input {i} has no tokens to embed (this model adds no BOS token)")
        out.append(ids)
    return out


def answer(call: EmbedCall, embedded: Embedded, total_ns: int, waited_ns: int) -> dict[str, Any]:
    """The response body: Ollama's ``/api/embed`` or ``/api/embeddings`` object."""
    vectors = embedded.vectors
    if call.legacy:
        return {"embedding": [float(x) for x in vectors[0]] if len(vectors) else []}
    if call.dimensions is not None and call.dimensions < vectors.shape[1]:
        vectors = vectors[:, : call.dimensions]
    rows = normalized(vectors.astype(np.float64))
    return {
        "model": call.model,
        "embeddings": [[float(x) for x in row] for row in rows],
        "total_duration": total_ns,
        "load_duration": waited_ns,
        "prompt_eval_count": embedded.tokens,
    }
