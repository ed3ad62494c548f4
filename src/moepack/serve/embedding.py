"""Embeddings of texts by the served model, in a llama.cpp context of their own.

llama-cpp-python embeds only with a ``Llama`` made with ``embedding=True``, whose one context
then gives embeddings instead of logits; the served ``Llama`` generates. llama.cpp takes more
than one context on a model, sharing its weights: each request gets a context made with
embeddings on, as long as its longest text (rounded up to llama.cpp's 256 tokens), and freed
when the request is done; the served context's KV cache (and the prefix cache) stay as they
were.

The context gives every token's last hidden state (llama.cpp's pooling ``none``) and the
pooling is done here: the model's own where its file names one (``<arch>.pooling_type``: CLS
the first token's, LAST the last one's), else the mean over the text's tokens (a generative
model's file names none). llama.cpp pools within one pass, so its own pooling would need a
whole text in one pass and a compute buffer as large as the text; this way a text goes in
passes of the served ``--batch``, and the context costs what the served one costs at that
length (its KV cache, one pass's buffers), for the request's duration.

The weights are read as any pass reads them: the pager serves their faults; the page-cache
prefetcher does not read ahead for this context (its callback is the served context's).
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
SAME_AS_SERVED = ("n_threads", "n_threads_batch", "flash_attn_type", "type_k", "type_v",
                  "rope_scaling_type", "rope_freq_base", "rope_freq_scale", "yarn_ext_factor",
                  "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow", "yarn_orig_ctx",
                  "offload_kqv", "op_offload", "swa_full")  # fmt: skip
"""The served context's settings the embedding context takes: its numbers are the served
model's, computed alike (the callback, the samplers and the sizes are its own)."""
CLS, LAST = 2, 3
"""llama.cpp's pooling types that are one token's state (``LLAMA_POOLING_TYPE_*``)."""


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
        """The pooled last hidden state of each token list (each 1 to ``limit`` tokens);
        ``Refused`` where llama.cpp cannot embed with this model (400) or the server stops
        (503)."""
        import llama_cpp

        n = self.size
        out = np.zeros((len(texts), n), np.float32)
        if not texts:
            return Embedded(out, 0)
        longest = max(len(t) for t in texts)
        if longest > self.limit or min(len(t) for t in texts) == 0:
            raise ValueError(f"each text is 1 to {self.limit} tokens, got {longest}")
        served = self.llm.context_params
        step = max(1, min(int(served.n_batch), int(served.n_ubatch), longest))
        ctx = self._context(-(-longest // PAD) * PAD, step)
        pooling = self._pooling()
        try:
            for row, tokens in enumerate(texts):
                llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
                total = np.zeros(n, np.float64)
                for start in range(0, len(tokens), step):
                    chunk = tokens[start : start + step]
                    states = _decode(ctx, chunk, start, n)
                    if pooling == CLS and start == 0:
                        out[row] = states[0]
                    elif pooling == LAST:
                        out[row] = states[-1]
                    else:
                        total += states.sum(axis=0, dtype=np.float64)
                if pooling not in (CLS, LAST):
                    out[row] = total / len(tokens)
        finally:
            llama_cpp.llama_free(ctx)
        return Embedded(out, sum(len(t) for t in texts))

    def _context(self, size: int, step: int) -> Any:
        import llama_cpp

        served = self.llm.context_params
        params = llama_cpp.llama_context_default_params()
        for name in SAME_AS_SERVED:
            setattr(params, name, getattr(served, name))
        params.n_ctx = size
        params.n_batch = params.n_ubatch = step
        params.n_seq_max = 1
        params.embeddings = True
        params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE
        params.no_perf = True
        if self._abort is None:
            self._abort = llama_cpp.ggml_abort_callback(lambda _data: bool(self.aborted()))
        params.abort_callback = self._abort
        with llama_log_dropped(llama_cpp):  # a model with a pooling of its own: a warning
            ctx = llama_cpp.llama_init_from_model(self.llm.model, params)
        if not ctx:
            raise Refused(_cannot(f"llama.cpp could not make a context of {size} tokens"))
        return ctx

    def _pooling(self) -> int:
        """The model's own pooling type (its GGUF key), 0 where it names none."""
        meta = self.llm.metadata
        own = str(meta.get(f"{meta.get('general.architecture', '')}.pooling_type", "0"))
        return int(own) if own.isdigit() else 0


def normalized(vectors: np.ndarray) -> np.ndarray:
    """Each row scaled to length 1 (a row of zeros stays zeros)."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.where(norms > 0, norms, 1.0)


def _decode(ctx: Any, tokens: list[int], start: int, n_embd: int) -> np.ndarray:
    """One pass over ``tokens`` at positions from ``start``: each token's last hidden state
    (a copy, one row each)."""
    import llama_cpp

    batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
    try:
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = True  # every token an output: its state is read
        rc = int(llama_cpp.llama_decode(ctx, batch))
    finally:
        llama_cpp.llama_batch_free(batch)
    if rc == 2:  # aborted: the server is stopping
        raise Refused(CUT)
    if rc != 0:
        raise Refused(_cannot(f"llama_decode returned {rc}"))
    ptr = llama_cpp.llama_get_embeddings(ctx)
    if not ptr:
        raise Refused(_cannot("llama.cpp gave no hidden states"))
    return np.ctypeslib.as_array(ptr, shape=(len(tokens), n_embd)).copy()


def _cannot(why: str) -> ApiProblem:
    return ApiProblem(400, f"this model cannot embed here: {why}", code="embedding_failed")
