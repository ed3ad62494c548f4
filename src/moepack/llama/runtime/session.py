"""One llama.cpp model and context through llama-cpp-python's low-level API (child side).

The high-level ``Llama`` makes its context in its constructor, so an eval callback cannot be
set on it; this opens the model and a context with our own ``llama_context_params``: an
optional ``EvalCallback``, the thread count, n_batch / n_ubatch (micro-batches) and the KV
cache type. A persistent ggml thread pool is attached to the context, so a graph split by the
eval callback does not start and join its worker threads again. Flash attention is off (its
CPU kernel differs from a float64 reference by ~2e-3). A ``WeightPlacement`` sets where the
weights go (default: llama.cpp's own choice, ``placement``); the anonymous memory before and
after the load is recorded. Only workers (``child``) call this:
llama.cpp aborts the process on some bad models. A model that does not load is
``LlamaFailed``; a failed decode is ``RuntimeError`` saying what was being decoded.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..prefetcher.evalcb import EvalCallback
from ..prefetcher.threadpool import ThreadPool
from ..protocol.child import could_not_run
from .placement import WeightPlacement
from .weights import anon_bytes

KV_TYPES = {"f32": 0, "f16": 1}


@dataclass(frozen=True)
class SessionParams:
    """How llama.cpp runs: context length, batch and micro-batch, threads, KV cache type."""

    n_ctx: int = 512
    n_batch: int = 512
    n_ubatch: int = 512
    threads: int = 2
    kv_type: str = "f32"
    pool_threads: int | None = None  # the thread pool's size (default: threads), to grow into
    threads_batch: int | None = None  # passes of more than one token (default: threads)


class LlamaSession:
    """A loaded model and one context (sequence 0) whose KV cache can be cleared between
    prompts; ``decode`` feeds tokens and returns the logits of the ones asked for."""

    def __init__(
        self,
        path: str,
        params: SessionParams,
        callback: EvalCallback | None = None,
        vocab_only: bool = False,
        placement: WeightPlacement | None = None,
    ) -> None:
        import llama_cpp
        from llama_cpp import _internals

        self._llama_cpp = llama_cpp
        llama_cpp.llama_log_set(_silent(), ctypes.c_void_p(0))
        mparams = llama_cpp.llama_model_default_params()
        mparams.vocab_only = vocab_only
        if placement is not None:
            placement.apply(mparams)
        self.anon_before_load = anon_bytes()
        try:
            # verbose: llama-cpp-python would point stderr at /dev/null during the load, and an
            # abort's reason with it; llama.cpp's own log goes through _silent() instead
            self.model = _internals.LlamaModel(path_model=path, params=mparams, verbose=True)
        except (ValueError, RuntimeError) as e:
            raise could_not_run(f"it does not load ({e})", path) from None
        self.anon_after_load = anon_bytes()
        self.n_vocab = self.model.n_vocab()
        self.n_ctx_train = self.model.n_ctx_train()
        self.callback = callback  # the ctypes callback must outlive the context
        self.params = params
        self._rows = 0
        self.ctx: Any = None
        self.threadpool: ThreadPool | None = None
        if vocab_only:  # tokenizer and metadata only: no context, no weights read
            return
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = params.n_ctx
        cparams.n_batch = params.n_batch
        cparams.n_ubatch = min(params.n_ubatch, params.n_batch)
        cparams.n_seq_max = 1
        batch_threads = params.threads_batch or params.threads
        cparams.n_threads = params.threads
        cparams.n_threads_batch = batch_threads
        cparams.flash_attn_type = 0
        cparams.type_k = KV_TYPES[params.kv_type]
        cparams.type_v = KV_TYPES[params.kv_type]
        cparams.no_perf = True
        if callback is not None:
            callback.install(cparams)
        try:
            self.ctx = _internals.LlamaContext(model=self.model, params=cparams, verbose=False)
        except (ValueError, RuntimeError) as e:
            self.model.close()
            raise could_not_run(f"it has no context of {params.n_ctx} tokens ({e})", path) from None
        self.n_ctx = self.ctx.n_ctx()
        pool = max(params.pool_threads or params.threads, params.threads, batch_threads)
        self.threadpool = ThreadPool(llama_cpp, self.ctx.ctx, pool)
        self._threads_batch = batch_threads
        self._batch = _internals.LlamaBatch(
            n_tokens=params.n_batch, embd=0, n_seq_max=1, verbose=False
        )

    def set_decode_threads(self, n: int) -> None:
        """llama.cpp's thread count for single-token passes (batches keep theirs)."""
        self._llama_cpp.llama_set_n_threads(self.ctx.ctx, n, self._threads_batch)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of ``text`` (BOS added when the model asks for it and ``add_special``)."""
        data = text.encode("utf-8")
        return list(self.model.tokenize(data, add_bos=add_special, special=True))

    def metadata(self) -> dict[str, str]:
        return dict(self.model.metadata())

    def start_token(self) -> int | None:
        """The token llama.cpp puts first in a sequence, or None when it adds none: its own
        answer (``llama_vocab_get_add_bos``, ``llama_vocab_bos``), which has already settled
        the metadata's keys against the tokenizer's defaults and the vocabulary (a metadata
        BOS id outside the vocabulary is replaced or dropped there)."""
        vocab = self.model.vocab
        if not self._llama_cpp.llama_vocab_get_add_bos(vocab):
            return None
        bos = int(self._llama_cpp.llama_vocab_bos(vocab))
        return bos if 0 <= bos < self.n_vocab else None

    def token_text(self, token: int) -> str:
        """The text of one token, special tokens included (llama-cpp-python's own
        ``token_to_piece`` returns its whole buffer, NULs and all)."""
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self._llama_cpp.llama_token_to_piece(self.model.vocab, token, buf, size, 0, True)
            if n >= 0:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = -n

    def is_end(self, token: int) -> bool:
        return bool(self._llama_cpp.llama_vocab_is_eog(self.model.vocab, token))

    def clear(self) -> None:
        """Forget every position (a new prompt starts at position 0)."""
        self._llama_cpp.llama_memory_clear(self.ctx.memory, True)

    def decode(self, tokens: Sequence[int], pos: int, all_logits: bool) -> np.ndarray:
        """Feed ``tokens`` at positions ``pos…`` and return the last token's logits.

        ``all_logits`` asks llama.cpp for every token's logits (read them with ``logits``):
        without it llama.cpp prunes the last layer to the last token. Raises ``RuntimeError``
        when llama.cpp fails (a callback handler's own error is raised first)."""
        n = len(tokens)
        b = self._batch.batch
        for i, tok in enumerate(tokens):
            b.token[i] = int(tok)
            b.pos[i] = pos + i
            b.seq_id[i][0] = 0
            b.n_seq_id[i] = 1
            b.logits[i] = all_logits or i == n - 1
        b.n_tokens = n
        rc = self._llama_cpp.llama_decode(self.ctx.ctx, b)
        if self.callback is not None:
            self.callback.raise_pending()
        if rc != 0:
            raise RuntimeError(
                f"llama_decode returned {rc} on {n} token{'s' if n != 1 else ''} at position "
                f"{pos}" + (f"-{pos + n - 1}" if n > 1 else "")
            )
        self._rows = n if all_logits else 1
        return self.logits()[-1]

    def forget_from(self, pos: int) -> None:
        """Drop every position from ``pos`` on (drafted tokens a verification rejected)."""
        self._llama_cpp.llama_memory_seq_rm(self.ctx.memory, 0, pos, -1)

    def logits(self) -> np.ndarray:
        """A copy of the logits ``[rows, vocab]`` of the last ``decode``."""
        ptr = self._llama_cpp.llama_get_logits(self.ctx.ctx)
        flat = np.ctypeslib.as_array(ptr, shape=(self._rows * self.n_vocab,))
        return flat.reshape(self._rows, self.n_vocab).copy()

    def close(self) -> None:
        if self.threadpool is not None:
            self.threadpool.close()
            self.threadpool = None
        if self.ctx is not None:
            self._batch.close()
            self.ctx.close()
        self.model.close()


GGML_LOG_LEVEL_ERROR = 4


def _log_sink(level: int, text: bytes, user_data: Any) -> None:
    """llama.cpp's log lines are dropped, but for errors: those go to stderr, whose last line
    the parent shows if llama.cpp then fails (the worker reports through its events)."""
    if level == GGML_LOG_LEVEL_ERROR and text:
        sys.stderr.write(text.decode("utf-8", errors="replace"))


def _make_silent_log() -> Any:
    import llama_cpp

    return llama_cpp.llama_log_callback(_log_sink)


class _LazySilentLog:
    """The ctypes log callback, made on first use and kept for the life of the process."""

    _cb: Any = None

    def __call__(self) -> Any:
        if self._cb is None:
            self._cb = _make_silent_log()
        return self._cb


_silent = _LazySilentLog()
