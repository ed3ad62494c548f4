"""llama.cpp's eval callback from Python: read chosen graph tensors while llama.cpp computes.

llama.cpp's scheduler calls ``cb_eval(tensor, ask, user_data)`` for every graph node: with
``ask`` true the callback says whether it wants that node; if so, the scheduler computes the
graph up to it, then calls again with ``ask`` false so the node can be read. This module turns
that into ``handler(name, layer, array)`` for the nodes whose names match, without patching
llama.cpp and without any per-architecture code:

- **Matching** is on llama.cpp's node names ``<base>-<layer>`` (``ffn_moe_topk-3``), anchored
  at both ends, so derived nodes such as ``ffn_moe_topk-3 (view)`` never match. A node name is
  parsed once; later asks are one dict lookup (graphs are rebuilt every ubatch, names repeat).
- **Reading** goes through libggml-base's exported ``ggml_backend_tensor_get`` with the
  tensor's own strides (``ffn_moe_topk`` is a strided view of the argsort): the span the view
  covers is copied, then viewed with the strides and made contiguous. The handler gets a
  fresh numpy array it may keep, shaped like ggml's ``ne`` reversed (numpy order) with leading
  size-1 axes dropped down to two: ``ffn_moe_topk`` ``[k, n_tokens]`` arrives as
  ``(n_tokens, k)``.
- **Order**: handlers run in graph order, before the nodes after the matched one are computed;
  the callback for ``ffn_moe_topk-<il>`` runs before that layer's expert matmuls, so work done
  in it (a prefetch) precedes them.
- **Errors**: an exception (or Ctrl-C) inside the handler must not cross the C boundary: it is
  stored, llama.cpp is told to stop computing (the ``llama_decode`` call then fails), and
  ``raise_pending()`` re-raises it in the caller's frame.
- **Lifetime**: the ctypes function object lives on the ``EvalCallback`` object; keep that
  object alive as long as the context that uses it (the ``install`` target keeps no
  reference of its own: a collected callback crashes the process).

Use::

    cb = EvalCallback(["ffn_moe_topk"], handler)
    params = llama_cpp.llama_context_default_params()
    cb.install(params)
    ctx = llama_cpp.llama_init_from_model(model, params)
    ...
    rc = llama_cpp.llama_decode(ctx, batch)
    cb.raise_pending()
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

GGML_MAX_DIMS = 4
GGML_MAX_OP_PARAMS = 64
GGML_MAX_SRC = 10
GGML_MAX_NAME = 64

# ggml_type -> numpy dtype, for the types graph nodes that are worth reading have.
GGML_NUMPY_TYPES: dict[int, np.dtype] = {
    0: np.dtype("<f4"),  # F32
    1: np.dtype("<f2"),  # F16
    24: np.dtype("i1"),  # I8
    25: np.dtype("<i2"),  # I16
    26: np.dtype("<i4"),  # I32
    27: np.dtype("<i8"),  # I64
    28: np.dtype("<f8"),  # F64
}

Handler = Callable[[str, int, np.ndarray], "bool | None"]


class GgmlTensor(ctypes.Structure):
    """The leading fields of ``struct ggml_tensor`` (ggml.h of the vendored llama.cpp), up to
    and including ``name``: enough to read type, shape, strides and name without a call."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
    ]


_NAME_OFFSET = GgmlTensor.name.offset  # type: ignore[attr-defined]
_LIB: Any = None


def ggml_base() -> Any:
    """libggml-base as loaded by llama-cpp-python (the same copy llama.cpp computes with)."""
    global _LIB
    if _LIB is None:
        from llama_cpp import _ggml

        lib = _ggml.libggml
        lib.ggml_backend_tensor_get.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_size_t,
        ]
        lib.ggml_backend_tensor_get.restype = None
        lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
        lib.ggml_nbytes.restype = ctypes.c_size_t
        _LIB = lib
    return _LIB


def read_tensor(ptr: int) -> np.ndarray:
    """A contiguous copy of the ggml tensor at ``ptr``, honouring its strides (views)."""
    lib = ggml_base()
    t = GgmlTensor.from_address(ptr)
    dtype = GGML_NUMPY_TYPES.get(int(t.type))
    if dtype is None:
        raise ValueError(f"ggml tensor {t.name.decode(errors='replace')!r}: type {t.type} unread")
    ne = [int(v) for v in t.ne]
    nb = [int(v) for v in t.nb]
    span = int(lib.ggml_nbytes(ptr))  # for a view: the bytes from its first to last element
    raw = np.empty(span, dtype=np.uint8)
    if span:
        lib.ggml_backend_tensor_get(ptr, raw.ctypes.data, 0, span)
    view = np.lib.stride_tricks.as_strided(
        raw.view(dtype)[:1] if span else np.empty(1, dtype),
        shape=tuple(reversed(ne)),
        strides=tuple(reversed(nb)),
        writeable=False,
    )
    out = np.ascontiguousarray(view)
    while out.ndim > 2 and out.shape[0] == 1:
        out = out[0]
    return out


def name_pattern(bases: Iterable[str]) -> re.Pattern[bytes]:
    """``^(base1|base2)-(layer)$`` over node names (bytes)."""
    alts = "|".join(re.escape(b) for b in bases)
    return re.compile(rb"^(" + alts.encode() + rb")-(\d+)$")


def op_index(name: str) -> int:
    """The ``enum ggml_op`` value of an op name (e.g. ``MUL_MAT_ID``) in the loaded ggml."""
    lib = ggml_base()
    lib.ggml_op_name.argtypes = [ctypes.c_int]
    lib.ggml_op_name.restype = ctypes.c_char_p
    want = name.encode()
    for i in range(1024):  # stops at the first match, before the end of ggml's name table
        if lib.ggml_op_name(i) == want:
            return i
    raise ValueError(f"ggml has no op {name!r}")


class EvalCallback:
    """An eval callback that delivers matching tensors to ``handler(name, layer, array)``.

    ``bases`` are node names without the ``-<layer>`` suffix. A handler that returns
    ``False`` stops the computation (``llama_decode`` then reports failure); any other return
    continues. ``calls`` counts the tensors delivered.

    Every tensor asked for costs a graph split (the scheduler computes up to it, synchronises
    its threads and calls back), which is what a prefetcher wants: control right after the
    router, before the expert matmuls. A reader that only records can pass ``defer`` instead:
    it maps each base name to a slot (say ``ids`` / ``weights``); matching nodes are then not
    asked for one by one, but remembered, a later node of a layer replacing an earlier one of
    the same slot, and read together at the layer's first ``MUL_MAT_ID`` (its expert matmul,
    which still needs the router's choice and weights, so both are intact): one split per
    layer instead of one per tensor.
    """

    def __init__(
        self,
        bases: Iterable[str],
        handler: Handler,
        defer: Mapping[str, str] | None = None,
    ) -> None:
        import llama_cpp

        self.bases = tuple(bases) + tuple(b for b in (defer or {}) if b not in tuple(bases))
        self.handler = handler
        self.calls = 0
        self.pending: BaseException | None = None
        self._defer = dict(defer or {})
        self._queued: dict[str, tuple[str, int, int]] = {}  # slot -> (base, layer, pointer)
        self._flush_op = op_index("MUL_MAT_ID") if self._defer else -1
        self._pattern = name_pattern(self.bases)
        self._names: dict[bytes, tuple[str, int] | None] = {}
        self._c_callback = llama_cpp.ggml_backend_sched_eval_callback(self._callback)

    def _parse(self, name: bytes) -> tuple[str, int] | None:
        m = self._pattern.match(name)
        parsed = (m.group(1).decode(), int(m.group(2))) if m else None
        self._names[name] = parsed
        return parsed

    def _deliver(self, base: str, layer: int, ptr: int) -> bool:
        self.calls += 1
        return self.handler(base, layer, read_tensor(ptr)) is not False

    def _callback(self, ptr: int, ask: bool, _user_data: int) -> bool:
        try:
            name = ctypes.string_at(ptr + _NAME_OFFSET)
            parsed = self._names[name] if name in self._names else self._parse(name)
            if ask:
                if self.pending is not None:
                    return False
                if parsed is not None and parsed[0] in self._defer:
                    self._queued[self._defer[parsed[0]]] = (parsed[0], parsed[1], ptr)
                    return False
                if self._queued and GgmlTensor.from_address(ptr).op == self._flush_op:
                    return True
                return parsed is not None
            ok = True
            if self._queued and GgmlTensor.from_address(ptr).op == self._flush_op:
                queued = list(self._queued.values())  # in the order first seen
                self._queued.clear()
                for base, layer, qptr in queued:
                    ok = self._deliver(base, layer, qptr) and ok
            if parsed is not None and parsed[0] not in self._defer:
                ok = self._deliver(parsed[0], parsed[1], ptr) and ok
            return ok
        except BaseException as e:  # never across the C boundary; re-raised by raise_pending
            if self.pending is None:
                self.pending = e
            return False

    @property
    def unflushed(self) -> int:
        """Deferred tensors seen but not yet delivered (non-zero after a computation means
        no expert matmul followed them)."""
        return len(self._queued)

    def install(self, params: Any) -> None:
        """Set ``cb_eval`` on llama.cpp context params (``llama_context_params``)."""
        params.cb_eval = self._c_callback
        params.cb_eval_user_data = None

    def raise_pending(self) -> None:
        """Re-raise what a handler raised during the last computation, if anything."""
        if self.pending is not None:
            e, self.pending = self.pending, None
            raise e
