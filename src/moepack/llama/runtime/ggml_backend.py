"""The few ggml-backend calls the weight placement needs, through llama-cpp-python's libggml.

llama-cpp-python binds llama.h only; where llama.cpp's CPU backend keeps a weight is ggml's
business (``ggml-backend.h``): the CPU device's extra buffer types (``CPU_REPACK``: weights
rewritten at load into the layouts its faster kernels read), its compile-time features (which
decide what ``CPU_REPACK`` takes), and a buffer's type name. Bound lazily, once per process,
from the same copy of libggml llama.cpp computes with.
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import Any

GGML_BACKEND_DEVICE_TYPE_CPU = 0
REPACK_BUFT = "CPU_REPACK"


class _Feature(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_char_p)]


@cache
def _lib() -> Any:
    from llama_cpp import _ggml

    lib = _ggml.libggml
    vp = ctypes.c_void_p
    for name, args, res in (
        ("ggml_backend_dev_by_type", [ctypes.c_int], vp),
        ("ggml_backend_dev_backend_reg", [vp], vp),
        ("ggml_backend_reg_get_proc_address", [vp, ctypes.c_char_p], vp),
        ("ggml_backend_buft_name", [vp], ctypes.c_char_p),
        ("ggml_backend_buffer_get_type", [vp], vp),
        ("ggml_backend_cpu_buffer_type", [], vp),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def _cpu() -> tuple[int, int]:
    """The CPU device and its backend registry."""
    lib = _lib()
    dev = lib.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    if not dev:
        raise RuntimeError("llama.cpp has no CPU backend")
    return dev, lib.ggml_backend_dev_backend_reg(dev)


@cache
def cpu_features() -> frozenset[str]:
    """The CPU backend's features as it was compiled (``AVX2``, ``AVX512``, ``REPACK``, …)."""
    _dev, reg = _cpu()
    fn = _lib().ggml_backend_reg_get_proc_address(reg, b"ggml_backend_get_features")
    if not fn:
        return frozenset()
    get = ctypes.CFUNCTYPE(ctypes.POINTER(_Feature), ctypes.c_void_p)(fn)
    feats, out, i = get(reg), set(), 0
    while feats and feats[i].name:
        if feats[i].value not in (b"0", b""):
            out.add(feats[i].name.decode())
        i += 1
    return frozenset(out)


@cache
def cpu_extra_bufts() -> dict[str, int]:
    """The CPU device's extra buffer types by name (``CPU_REPACK`` where the build has it):
    what ``use_extra_bufts`` adds to the list a weight's buffer type is chosen from."""
    dev, reg = _cpu()
    fn = _lib().ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not fn:
        return {}
    get = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fn)
    bufts, out, i = get(dev), {}, 0
    while bufts and bufts[i]:
        out[buft_name(bufts[i])] = int(bufts[i])
        i += 1
    return out


def buft_name(buft: int) -> str:
    return (_lib().ggml_backend_buft_name(buft) or b"?").decode()


def buffer_type_name(buffer: int | None) -> str:
    """The type name of a ggml buffer (``CPU_Mapped``, ``CPU_REPACK``, ``CPU``), or ``-``."""
    if not buffer:
        return "-"
    return buft_name(_lib().ggml_backend_buffer_get_type(buffer))
