"""ggml's own C dequantisers (``ggml_get_type_traits(type)->to_float`` in libggml-base),
through ctypes: the decoder llama.cpp itself runs. ctypes releases the GIL during the call, so
tensors dequantise in parallel threads."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ..engine import DequantEngine

ORDER = 20

ToFloat = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class TypeTraits(ctypes.Structure):
    """``struct ggml_type_traits`` (ggml.h)."""

    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


def find_libggml_base() -> Path | None:
    """libggml-base as llama-cpp-python ships it (None when llama-cpp-python is absent)."""
    try:
        import llama_cpp
    except Exception:
        return None
    root = Path(llama_cpp.__file__).parent
    for pattern in ("lib/libggml-base.so*", "lib/libggml-base.dylib", "**/libggml-base.so*"):
        found = sorted(root.glob(pattern))
        if found:
            return found[0]
    return None


@functools.cache
def _library() -> ctypes.CDLL | str:
    path = find_libggml_base()
    if path is None:
        return "libggml-base not found: install llama-cpp-python (pip install 'moepack[llama]')"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return f"cannot load {path}: {e}"
    lib.ggml_get_type_traits.restype = ctypes.POINTER(TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    return lib


class GgmlEngine(DequantEngine):
    name = "ggml"
    aliases = ("ggml-c",)

    def unavailable_reason(self) -> str | None:
        lib = _library()
        return lib if isinstance(lib, str) else None

    @functools.cache  # noqa: B019 - one engine object per process; types are few
    def _to_float(self, qtype: GGMLQuantizationType) -> Callable[[int, int, int], None] | None:
        lib = _library()
        if isinstance(lib, str) or qtype not in GGML_QUANT_SIZES:
            return None
        traits = lib.ggml_get_type_traits(int(qtype)).contents
        block, size = GGML_QUANT_SIZES[qtype]
        if not traits.to_float or traits.blck_size != block or traits.type_size != size:
            return None  # a type this build removed or lays out differently
        fn: Callable[[int, int, int], None] = ToFloat(traits.to_float)
        return fn

    def supports(self, qtype: GGMLQuantizationType) -> bool:
        return self._to_float(qtype) is not None

    def dequantize(self, raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
        fn = self._to_float(qtype)
        if fn is None:
            raise ValueError(f"ggml cannot dequantise {qtype.name}")
        src = np.ascontiguousarray(raw, dtype=np.uint8)
        block, size = GGML_QUANT_SIZES[qtype]
        out = np.empty(src.size // size * block, dtype=np.float32)
        fn(src.ctypes.data, out.ctypes.data, out.size)
        return out


PLUGIN = GgmlEngine()
