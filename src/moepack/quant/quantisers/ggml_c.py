"""ggml's own quantisers (``ggml_quantize_chunk`` in libggml-base) through ctypes: what
llama.cpp's ``llama-quantize`` runs, for every type that needs no importance matrix."""

from __future__ import annotations

import ctypes
import functools

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ..engines.ggml_c import _library
from ..quantiser import Quantiser

ORDER = 20


@functools.cache
def _quantize_chunk() -> ctypes._CFuncPtr | str:  # type: ignore[name-defined]
    lib = _library()
    if isinstance(lib, str):
        return lib
    try:
        fn = lib.ggml_quantize_chunk
        needs = lib.ggml_quantize_requires_imatrix
    except AttributeError:
        return "this libggml-base has no ggml_quantize_chunk"
    fn.restype = ctypes.c_size_t
    fn.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
    ]
    needs.restype = ctypes.c_bool
    needs.argtypes = [ctypes.c_int]
    return fn


@functools.cache
def _requires_imatrix(qtype: GGMLQuantizationType) -> bool:
    lib = _library()
    return isinstance(lib, str) or bool(lib.ggml_quantize_requires_imatrix(int(qtype)))


class GgmlQuantiser(Quantiser):
    name = "ggml"
    aliases = ("ggml-c",)

    def unavailable_reason(self) -> str | None:
        fn = _quantize_chunk()
        return fn if isinstance(fn, str) else None

    def supports(self, qtype: GGMLQuantizationType) -> bool:
        if self.unavailable_reason() is not None or qtype not in GGML_QUANT_SIZES:
            return False
        if qtype in (GGMLQuantizationType.F32,):
            return False
        return not _requires_imatrix(qtype)

    def quantize(self, rows: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
        fn = _quantize_chunk()
        if isinstance(fn, str):
            raise ValueError(fn)
        src = np.ascontiguousarray(rows, dtype=np.float32)
        n_rows, n_per_row = src.shape
        block, size = GGML_QUANT_SIZES[qtype]
        if n_per_row % block:
            raise ValueError(f"rows of {n_per_row} values are not whole {qtype.name} blocks")
        out = np.empty(n_rows * (n_per_row // block) * size, dtype=np.uint8)
        written = fn(int(qtype), src.ctypes.data, out.ctypes.data, 0, n_rows, n_per_row, None)
        if written != out.size:
            raise ValueError(f"ggml wrote {written} bytes of {qtype.name}, expected {out.size}")
        return out


PLUGIN = GgmlQuantiser()
