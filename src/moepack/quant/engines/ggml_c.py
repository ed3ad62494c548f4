"""ggml's own C dequantisers (``ggml_get_type_traits(type)->to_float`` in libggml-base, bound
once in ``moepack.checkpoint.ggml_c``): the decoder llama.cpp itself runs. ctypes releases the
GIL during the call, so tensors dequantise in parallel threads."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ...checkpoint.ggml_c import ggml_library, type_traits
from ..engine import DequantEngine

ORDER = 20

ToFloat = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class GgmlEngine(DequantEngine):
    name = "ggml"
    aliases = ("ggml-c",)

    def unavailable_reason(self) -> str | None:
        lib = ggml_library()
        return lib if isinstance(lib, str) else None

    @functools.cache  # noqa: B019 - one engine object per process; types are few
    def _to_float(self, qtype: GGMLQuantizationType) -> Callable[[int, int, int], None] | None:
        traits = type_traits(qtype)
        if traits is None or not traits.to_float:
            return None
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
