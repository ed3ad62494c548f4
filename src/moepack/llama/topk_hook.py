"""The router's choice from llama.cpp's eval callback, with no patch to llama.cpp.

ggml's scheduler asks the callback about every graph node (``ask`` true) and, for the nodes it
said yes to, calls it again once the node is computed (``ask`` false) before computing anything
after it. Every MoE family names its router's choice ``ffn_moe_topk-<il>`` (I32 ``[k,
n_tokens]``, a strided view), and it is computed before that layer's expert matmuls: work done
in the second call — a prefetch — precedes them.

Runs only inside the llama.cpp child process (it imports llama_cpp).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import numpy as np

TOPK_PREFIX = b"ffn_moe_topk-"


class _TensorHead(ctypes.Structure):
    """The leading fields of ``struct ggml_tensor`` (ggml.h): type, buffer, ne[4], nb[4]."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
    ]


def _ggml_base() -> ctypes.CDLL:
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        if (lib_dir / name).exists():
            lib = ctypes.CDLL(str(lib_dir / name))
            break
    else:
        lib = ctypes.CDLL("libggml-base.so")
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_backend_tensor_get.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
    ]
    lib.ggml_backend_tensor_get.restype = None
    return lib


def topk_layer(name: bytes) -> int | None:
    """The layer of an ``ffn_moe_topk-<il>`` node, or ``None`` for any other name (derived
    names such as ``ffn_moe_topk-3 (view)`` included: the match is anchored at both ends)."""
    if not name.startswith(TOPK_PREFIX):
        return None
    tail = name[len(TOPK_PREFIX) :]
    return int(tail) if tail.isdigit() else None


OnTopk = Callable[[int, np.ndarray], None]
"""Called with the layer and the ids ``[n_tokens, k]`` (router order) of each micro-batch."""


class TopkHook:
    """An eval callback that hands each MoE layer's top-k ids to ``on_topk``.

    An exception raised by ``on_topk`` cannot cross the C callback: it is kept in ``error``,
    the callback tells ggml to stop, and the caller re-raises it after ``llama_decode``.
    """

    def __init__(self, on_topk: OnTopk) -> None:
        import llama_cpp

        self._lib = _ggml_base()
        self._on_topk = on_topk
        self.error: BaseException | None = None
        self._buf = ctypes.create_string_buffer(4096)
        # Keep the ctypes callback referenced for the context's life (else a segfault).
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._call)

    def _call(self, tensor: int, ask: bool, user_data: int) -> bool:
        name = self._lib.ggml_get_name(tensor) or b""
        layer = topk_layer(name)
        if ask:
            return layer is not None
        if layer is None or self.error is not None:
            return self.error is None
        try:
            self._on_topk(layer, self._read_ids(tensor))
        except BaseException as e:  # re-raised by the caller after llama_decode
            self.error = e
            return False
        return True

    def _read_ids(self, tensor: int) -> np.ndarray:
        head = _TensorHead.from_address(tensor)
        k, n_tokens = int(head.ne[0]), int(head.ne[1])
        nb0, nb1 = int(head.nb[0]), int(head.nb[1])
        nbytes = int(self._lib.ggml_nbytes(tensor))
        if nbytes > len(self._buf):
            self._buf = ctypes.create_string_buffer(nbytes)
        self._lib.ggml_backend_tensor_get(tensor, self._buf, 0, nbytes)
        flat = np.frombuffer(self._buf, dtype=np.int32, count=nbytes // 4)
        ids = np.lib.stride_tricks.as_strided(flat, shape=(n_tokens, k), strides=(nb1, nb0))
        return np.array(ids, dtype=np.int32)

    def raise_pending(self) -> None:
        """Re-raise what ``on_topk`` raised during the last decode, if anything."""
        if self.error is not None:
            err, self.error = self.error, None
            raise err
