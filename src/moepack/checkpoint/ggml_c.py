"""ggml's own C codecs (libggml-base, as llama-cpp-python ships it) through ctypes: the
quantiser llama.cpp's ``llama-quantize`` runs (``ggml_quantize_chunk``) and the per-type
traits that hold its decoders. One place binds the library, for the synthetic writer here and
for ``quant``'s engines above. ctypes releases the GIL during each call, so threads quantise
in parallel."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MISSING = "libggml-base not found: install llama-cpp-python (pip install 'moepack[llama]')"


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
def ggml_library() -> ctypes.CDLL | str:
    """The loaded library, or why it cannot be loaded."""
    path = find_libggml_base()
    if path is None:
        return MISSING
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return f"cannot load {path}: {e}"
    lib.ggml_get_type_traits.restype = ctypes.POINTER(TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    return lib


def type_traits(qtype: GGMLQuantizationType) -> TypeTraits | None:
    """ggml's traits of ``qtype`` when this build lays it out as gguf-py does (else None)."""
    lib = ggml_library()
    if isinstance(lib, str) or qtype not in GGML_QUANT_SIZES:
        return None
    traits: TypeTraits = lib.ggml_get_type_traits(int(qtype)).contents
    block, size = GGML_QUANT_SIZES[qtype]
    if traits.blck_size != block or traits.type_size != size:
        return None  # a type this build removed or lays out differently
    return traits


@functools.cache
def _quantize_chunk() -> ctypes._CFuncPtr | str:  # type: ignore[name-defined]
    lib = ggml_library()
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


def quantiser_unavailable() -> str | None:
    """Why ggml's quantiser cannot run here (None when it can)."""
    fn = _quantize_chunk()
    return fn if isinstance(fn, str) else None


@functools.cache
def requires_imatrix(qtype: GGMLQuantizationType) -> bool:
    """ggml refuses to quantise ``qtype`` without an importance matrix (or cannot at all)."""
    lib = ggml_library()
    return isinstance(lib, str) or bool(lib.ggml_quantize_requires_imatrix(int(qtype)))


def can_quantise(qtype: GGMLQuantizationType) -> bool:
    """ggml quantises ``qtype`` here, without an importance matrix (F32 is not a quantisation)."""
    if quantiser_unavailable() is not None or qtype == GGMLQuantizationType.F32:
        return False
    return type_traits(qtype) is not None and not requires_imatrix(qtype)


def quantise_rows(rows: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """``rows`` (n_rows x n_per_row F32) as ``qtype`` blocks, bytes as ggml writes them."""
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
