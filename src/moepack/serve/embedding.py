"""Embeddings of texts by the served model, in a llama.cpp context of their own.

llama-cpp-python embeds only with a ``Llama`` made with ``embedding=True``, whose one context
then gives embeddings instead of logits; the served ``Llama`` generates. llama.cpp takes more
than one context on a model, sharing its weights: each request gets a context made with
embeddings on, as large as its longest text (rounded up to llama.cpp's 256 tokens), every
text in one pass (``n_ubatch`` is the context: llama.cpp pools within a pass, so a text split
over two would be the mean of its last part only), and freed when the request is done. The
served context's KV cache (and the prefix cache) stay as they were.

Pooling is the model's own where its file names one (``<arch>.pooling_type``: an embedding
model's), else the mean of the last layer's hidden states over the text's tokens (a
generative model's file names none). The weights are read as any pass reads them: the pager
serves their faults; the page-cache prefetcher does not read ahead for this context (its
callback is the served context's).

What it costs: that context's KV cache and compute buffers, for the request's duration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..llama.runtime.weights import llama_log_dropped
from .shapes import ApiProblem, Refused
from .stopping import CUT

PAD = 256


@dataclass(frozen=True)
class Embedded:
    """The vectors of a request's texts (one row each, float32) and the tokens they took."""

    vectors: np.ndarray
    tokens: int


class Embedder:
    """Embeddings by the served ``Llama`` ``llm`` (its model and tokenizer). ``limit``: the
    most tokens a text may have (the served context, or ``--max-prompt-tokens``); ``admit``:
    called before a request runs (it raises ``Refused`` once the server is stopping);
    ``aborted``: whether a pass in progress should stop (the server is stopping)."""

    def __init__(
        self,
        llm: Any,
        limit: int,
        admit: Callable[[], None] = lambda: None,
        aborted: Callable[[], bool] = lambda: False,
    ) -> None:
        self.llm = llm
        self.limit = limit
        self.admit = admit
        self.aborted = aborted
        self._abort: Any = None  # the ctypes callback, kept alive while a context holds it

    @property
    def size(self) -> int:
        """The length of each vector."""
        import llama_cpp

        return int(llama_cpp.llama_model_n_embd(self.llm.model))

    def tokens(self, text: str) -> list[int]:
        """``text`` as the model's tokens (its BOS first where the model adds one)."""
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=False))

    def embed(self, texts: Sequence[list[int]]) -> Embedded:
        """The pooled last hidden state of each token list (each within ``limit``, none
        empty); ``Refused`` (400) where llama.cpp cannot embed with this model."""
        import llama_cpp

        n = self.size
        out = np.zeros((len(texts), n), np.float32)
        if not texts:
            return Embedded(out, 0)
        longest = max(len(t) for t in texts)
        if longest > self.limit or min(len(t) for t in texts) == 0:
            raise ValueError(f"each text is 1 to {self.limit} tokens, got {longest}")
        ctx = self._context(-(-longest // PAD) * PAD)
        try:
            for row, tokens in enumerate(texts):
                llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
                _decode(ctx, tokens)
                ptr = llama_cpp.llama_get_embeddings_seq(ctx, 0)
                if not ptr:
                    raise Refused(_cannot("llama.cpp gave no pooled embedding"))
                out[row] = np.ctypeslib.as_array(ptr, shape=(n,))
        finally:
            llama_cpp.llama_free(ctx)
        return Embedded(out, sum(len(t) for t in texts))

    def _context(self, size: int) -> Any:
        import llama_cpp

        served = self.llm.context_params
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = size
        params.n_seq_max = 1
        params.n_threads = served.n_threads
        params.n_threads_batch = served.n_threads_batch
        params.embeddings = True
        params.pooling_type = self._pooling()
        params.no_perf = True
        if self._abort is None:
            self._abort = llama_cpp.ggml_abort_callback(lambda _data: bool(self.aborted()))
        params.abort_callback = self._abort
        with llama_log_dropped(llama_cpp):  # the pooling it was asked for, a warning each time
            ctx = llama_cpp.llama_init_from_model(self.llm.model, params)
        if not ctx:
            raise Refused(_cannot(f"llama.cpp could not make a context of {size} tokens"))
        return ctx

    def _pooling(self) -> int:
        import llama_cpp

        meta = self.llm.metadata
        own = meta.get(f"{meta.get('general.architecture', '')}.pooling_type")
        if own is not None and str(own).lstrip("-").isdigit() and int(own) > 0:
            return int(own)
        return int(llama_cpp.LLAMA_POOLING_TYPE_MEAN)


def normalized(vectors: np.ndarray) -> np.ndarray:
    """Each row scaled to length 1 (a row of zeros stays zeros)."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.where(norms > 0, norms, 1.0)


def _decode(ctx: Any, tokens: list[int]) -> None:
    import llama_cpp

    batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
    try:
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = True  # in embedding mode every token is an output
        rc = int(llama_cpp.llama_decode(ctx, batch))
    finally:
        llama_cpp.llama_batch_free(batch)
    if rc == 2:  # aborted: the server is stopping
        raise Refused(CUT)
    if rc != 0:
        raise Refused(_cannot(f"llama_decode returned {rc}"))


def _cannot(why: str) -> ApiProblem:
    return ApiProblem(400, f"this model cannot embed here: {why}", code="embedding_failed")
