"""A persistent ggml CPU thread pool attached to a llama.cpp context.

Without one, ggml's CPU backend makes (and joins) its worker threads for every graph it
computes. An eval callback that asks for a node splits the graph there, so a callback on each
MoE layer's top-k would pay thread creation twice per layer per token: on a tiny model that
cut decode from hundreds of tokens/s to tens. llama.cpp's own command-line tools attach a
pool the same way (``llama_attach_threadpool``), so runs with and without the callback use it.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

_PARAMS_BYTES = 1024  # struct ggml_threadpool_params is 528 bytes (cpumask[512] first)


class ThreadPool:
    """``n_threads`` ggml workers for the context's decode and batch graphs."""

    def __init__(self, llama_cpp: Any, ctx: Any, n_threads: int) -> None:
        lib_dir = Path(llama_cpp.__file__).parent / "lib"
        self._base = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
        self._cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"))
        self._llama = ctypes.CDLL(str(lib_dir / "libllama.so"))
        self._base.ggml_threadpool_params_init.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self._base.ggml_threadpool_params_init.restype = None
        self._cpu.ggml_threadpool_new.argtypes = [ctypes.c_void_p]
        self._cpu.ggml_threadpool_new.restype = ctypes.c_void_p
        self._cpu.ggml_threadpool_free.argtypes = [ctypes.c_void_p]
        self._cpu.ggml_threadpool_free.restype = None
        self._llama.llama_attach_threadpool.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        self._llama.llama_attach_threadpool.restype = None
        self._llama.llama_detach_threadpool.argtypes = [ctypes.c_void_p]
        self._llama.llama_detach_threadpool.restype = None
        params = ctypes.create_string_buffer(_PARAMS_BYTES)
        self._base.ggml_threadpool_params_init(params, n_threads)
        self.pool = self._cpu.ggml_threadpool_new(params)
        if not self.pool:
            raise RuntimeError("ggml could not create a thread pool")
        self._ctx = ctx
        self._llama.llama_attach_threadpool(ctx, self.pool, self.pool)

    def close(self) -> None:
        if self.pool:
            self._llama.llama_detach_threadpool(self._ctx)
            self._cpu.ggml_threadpool_free(self.pool)
            self.pool = None
