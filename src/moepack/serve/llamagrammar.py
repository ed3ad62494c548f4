"""llama.cpp's side of grammars on the served model: whether it takes one, and whether any token
is left to sample.

llama.cpp's grammar sampler masks every token its grammar does not allow; when it allows none
(a character no token holds, a token the vocabulary has not), the chain still picks one and
the grammar's ``accept`` throws through C: SIGABRT, the worker gone. ``Candidates`` asks the
grammar sampler alone, on a few tokens first (the end-of-generation ones and every token of
one byte: with llama.cpp's partial UTF-8 matching, a grammar that allows any token allows
one of those on a vocabulary with byte tokens), on the whole vocabulary if none of those
passes. ``vocabulary_of`` uses it on a new grammar's start (``checks`` refuses one that allows
nothing), and ``guard_samplers`` before every token a grammar constrains: a grammar that runs
out of tokens later ends its request with a 400 instead of the worker.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from .checks import Vocabulary
from .shapes import ApiProblem, Refused

UNPARSED = "llama.cpp cannot parse this grammar (GBNF, with a `root` rule)"
NOTHING_FIRST = "the grammar allows no token of this model's vocabulary at its start"


class _Array:
    """A ``llama_token_data_array`` of fixed token ids, reused for every question."""

    def __init__(self, ids: np.ndarray) -> None:
        import llama_cpp

        self.buffer = (llama_cpp.llama_token_data * max(1, len(ids)))()
        self.view = np.ctypeslib.as_array(self.buffer)[: len(ids)]
        self.view["id"] = ids
        self.array = llama_cpp.llama_token_data_array(
            data=ctypes.cast(self.buffer, llama_cpp.llama_token_data_p),
            size=len(ids),
            selected=-1,
            sorted=False,
        )

    def any_allowed(self, sampler: Any) -> bool:
        import llama_cpp

        self.view["logit"] = 0.0
        self.view["p"] = 0.0
        self.array.size = len(self.view)
        self.array.selected = -1
        self.array.sorted = False
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(self.array))
        return bool(np.isfinite(self.view["logit"][: self.array.size]).any())


class Candidates:
    """Whether a grammar sampler (its state now) allows any token of the model (see the
    module docstring); one question at a time."""

    def __init__(self, llm: Any) -> None:
        import llama_cpp

        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        n = int(llama_cpp.llama_vocab_n_tokens(vocab))
        buf = ctypes.create_string_buffer(8)
        few = [
            i
            for i in range(n)
            if llama_cpp.llama_vocab_is_eog(vocab, i)
            or llama_cpp.llama_token_to_piece(vocab, i, buf, len(buf), 0, True) == 1
        ]
        self._few = _Array(np.array(few, dtype=np.int32))
        self._all = _Array(np.arange(n, dtype=np.int32))
        self._lock = threading.Lock()

    def any_allowed(self, sampler: Any) -> bool:
        with self._lock:
            return self._few.any_allowed(sampler) or self._all.any_allowed(sampler)


def vocabulary_of(llm: Any, candidates: Candidates | None = None) -> Vocabulary:
    """The ``Vocabulary`` of a loaded ``Llama``: its size, its longest piece (every token's
    piece asked of llama.cpp once, specials included: a prompt is tokenised with them), and
    llama.cpp's verdict on a grammar (a sampler made, asked by ``candidates`` for its first
    tokens, freed)."""
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
    asked = candidates if candidates is not None else Candidates(llm)

    def grammar(text: str) -> str | None:
        sampler = llama_cpp.llama_sampler_init_grammar(vocab, text.encode("utf-8"), b"root")
        if not sampler:
            return UNPARSED
        try:
            return None if asked.any_allowed(sampler) else NOTHING_FIRST
        finally:
            llama_cpp.llama_sampler_free(sampler)

    return Vocabulary(n_vocab=n, longest_piece=max(1, longest), grammar=grammar)


def guard_samplers(llm: Any, candidates: Candidates) -> None:
    """Every sampler chain ``llm`` makes with a grammar asks ``candidates`` before each token
    whether the grammar allows any; if not, the generation raises ``Refused`` (400
    ``invalid_grammar``) where llama.cpp would abort (``Llama._init_sampler`` wrapped on this
    instance)."""
    inner: Callable[..., Any] = llm._init_sampler

    def init_sampler(*args: Any, **kwargs: Any) -> Any:
        chain = inner(*args, **kwargs)
        grammar = _grammar_in(chain.sampler) if kwargs.get("grammar") is not None else None
        if grammar is None:
            return chain
        sample = chain.sample
        sampled = [0]

        def checked(ctx: Any, idx: int = -1) -> int:
            if not candidates.any_allowed(grammar):
                raise Refused(
                    ApiProblem(
                        400,
                        f"the grammar allows no token of this model's vocabulary after "
                        f"{sampled[0]} sampled (it asks for a character or token no token "
                        "gives)",
                        "grammar",
                        "invalid_grammar",
                    )
                )
            sampled[0] += 1
            return int(sample(ctx, idx))

        chain.sample = checked
        return chain

    llm._init_sampler = init_sampler


def _grammar_in(chain: Any) -> Any:
    """The grammar sampler of a sampler chain (None: it has none). Only a sampler that has a
    name is asked it: llama-cpp-python's own (``logit_bias``'s) leaves it NULL, which
    ``llama_sampler_name`` would call."""
    import llama_cpp

    for i in range(int(llama_cpp.llama_sampler_chain_n(chain))):
        sampler = llama_cpp.llama_sampler_chain_get(chain, i)
        iface = sampler.contents.iface if sampler else None
        if not iface or not iface.contents.name:
            continue
        if llama_cpp.llama_sampler_name(sampler) == b"grammar":
            return sampler
    return None
