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
- **Speed**: the asks (one per graph node, ~70 per MoE layer per token) are answered by a
  small C gate (``evalgate``, compiled once per process with the system's C compiler) so that
  Python runs only for the reads; without a compiler they are answered in Python (``kind``).
- **Switch**: ``enabled = False`` answers every ask "no" (in C with the gate), so a pass
  with nothing to read runs as if no callback were set: no split, no Python call.
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

from .evalgate import (
    MAX_BASE_CHARS,
    MAX_BASES,
    MAX_RECORDS,
    MAX_SLOTS,
    GateState,
    Record,
    compile_gate,
)

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


_NAME_OFFSET: int = GgmlTensor.name.offset
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
    """A contiguous copy of the ggml tensor at ``ptr``, honouring its strides (views).

    Kept cheap (it runs once per read inside llama.cpp's compute): the span a view covers is
    ``elsize + sum((ne - 1) * nb)`` (``ggml_nbytes`` for the unblocked types read here), one
    ``ggml_backend_tensor_get`` copies it, and numpy views it with the strides."""
    t = GgmlTensor.from_address(ptr)
    dtype = GGML_NUMPY_TYPES.get(t.type)
    if dtype is None:
        raise ValueError(f"ggml tensor {t.name.decode(errors='replace')!r}: type {t.type} unread")
    ne, nb = tuple(t.ne), tuple(t.nb)
    shape, strides = ne[::-1], nb[::-1]
    while len(shape) > 2 and shape[0] == 1:
        shape, strides = shape[1:], strides[1:]
    span = dtype.itemsize + sum((n - 1) * s for n, s in zip(ne, nb, strict=True))
    if 0 in ne:
        return np.empty(shape, dtype=dtype)
    buf = (ctypes.c_char * span)()
    ggml_base().ggml_backend_tensor_get(ptr, buf, 0, span)
    return np.ndarray(shape, dtype=dtype, buffer=buf, strides=strides).copy()


def tensor_offsets() -> list[int]:
    """Byte offsets in ``struct ggml_tensor`` of name, ne, nb, data, type, src, buffer (what
    C code that reads graph tensors is told)."""
    fields = ("name", "ne", "nb", "data", "type", "src", "buffer")
    return [getattr(GgmlTensor, f).offset for f in fields]


def host_check_address() -> int:
    """The address of ggml's ``ggml_backend_buffer_is_host`` (C code checks a tensor is in
    host memory before it reads it)."""
    lib = ggml_base()
    fn = ctypes.cast(lib.ggml_backend_buffer_is_host, ctypes.c_void_p).value
    assert fn is not None
    return int(fn)


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
    layer instead of one per tensor. ``flush_at="read"`` delivers them instead just before
    the next node asked for directly (the prefetcher: the router's input with its top-k).

    ``inputs`` maps a base name to one of its node's sources: that source is delivered in
    place of the node (``{"ffn_moe_logits": 1}``: the router's input activations, which
    llama.cpp names differently in every family, through the one node all of them name).
    """

    def __init__(
        self,
        bases: Iterable[str],
        handler: Handler,
        defer: Mapping[str, str] | None = None,
        use_gate: bool = True,
        record_bytes: int = 0,
        flush_at: str = "expert-matmul",
        inputs: Mapping[str, int] | None = None,
    ) -> None:
        import llama_cpp

        if flush_at not in ("expert-matmul", "read"):
            raise ValueError(f"flush_at is 'expert-matmul' or 'read', not {flush_at!r}")
        self.bases = tuple(bases) + tuple(b for b in (defer or {}) if b not in tuple(bases))
        self.handler = handler
        self.calls = 0
        self.pending: BaseException | None = None
        self._enabled = True
        self._defer = dict(defer or {})
        self._queued: dict[str, tuple[str, int, int]] = {}  # slot -> (base, layer, pointer)
        # "read": deferred nodes go with the next node asked for directly (no split of their own)
        self._flush_on_read = flush_at == "read"
        flushes = self._defer and not self._flush_on_read
        self._flush_op = op_index("MUL_MAT_ID") if flushes else -1  # -1: never asked for
        self._inputs = dict(inputs or {})
        self._pattern = name_pattern(self.bases)
        self._names: dict[bytes, tuple[str, int] | None] = {}
        self._c_callback = llama_cpp.ggml_backend_sched_eval_callback(self._callback)
        self._gate_lib = compile_gate() if use_gate else None
        self._state: GateState | None = None
        if self._gate_lib is not None:
            self._state = self._gate_state()
            self._state.enabled = 1
            if record_bytes and self._defer:
                self._start_recording(record_bytes)
            self._c_forward = llama_cpp.ggml_backend_sched_eval_callback(self._forward)
            self._state.forward = ctypes.cast(self._c_forward, ctypes.c_void_p).value
            fn = ctypes.cast(self._gate_lib.moepack_eval_gate, ctypes.c_void_p).value
            assert fn is not None
            self._c_gate = llama_cpp.ggml_backend_sched_eval_callback(fn)

    def _start_recording(self, nbytes: int) -> None:
        """Let the C gate copy deferred reads into ``nbytes`` of buffer (drained by Python)."""
        st = self._state
        assert st is not None
        self._rec_buf = (ctypes.c_char * nbytes)()
        self._recs = (Record * MAX_RECORDS)()
        lib = ggml_base()
        lib.ggml_backend_buffer_is_host.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_buffer_is_host.restype = ctypes.c_bool
        st.record = 1
        st.ne_offset = GgmlTensor.ne.offset
        st.nb_offset = GgmlTensor.nb.offset
        st.data_offset = GgmlTensor.data.offset
        st.buffer_offset = GgmlTensor.buffer.offset
        st.is_host = ctypes.cast(lib.ggml_backend_buffer_is_host, ctypes.c_void_p).value
        st.buf = ctypes.addressof(self._rec_buf)
        st.cap = nbytes
        st.recs = ctypes.addressof(self._recs)
        st.max_rec = MAX_RECORDS

    def set_hook(self, base: str, fn: int, ctx: int, forward: bool) -> bool:
        """Have the C gate call ``fn(ctx, tensor, queued)`` (addresses) on every read of
        ``base`` before Python, which is told too only when ``forward``. False without the
        C gate (the caller then does the work in its handler)."""
        st = self._state
        if st is None:
            return False
        st.hook_base = self.bases.index(base)
        st.hook_ctx = ctx
        st.hook_forward = 1 if forward else 0
        st.hook = fn
        return True

    def slot_index(self, base: str) -> int:
        """Which ``queued`` entry holds a deferred ``base`` (for a C hook)."""
        return self._slot_names.index(self._defer[base])

    @property
    def recording(self) -> bool:
        """True when deferred reads are copied in C and delivered by ``drain``."""
        return self._state is not None and bool(self._state.record)

    def drain(self) -> None:
        """Deliver what the C gate recorded during the last computation, in graph order (a
        no-op unless ``recording``: then deliveries happened during the computation)."""
        st = self._state
        if st is None or not st.record:
            return
        failed, n = int(st.failed), int(st.n_rec)
        st.failed = st.n_rec = st.used = 0
        if failed:
            reason = {1: "the record buffer is full", 2: "a tensor type it cannot copy"}
            raise RuntimeError(f"eval gate: {reason.get(failed, 'a tensor outside host memory')}")
        raw = memoryview(self._rec_buf).cast("B")
        for r in self._recs[:n]:
            dtype = GGML_NUMPY_TYPES[r.type]
            count = int(r.rows) * int(r.ne0)
            arr = np.frombuffer(raw, dtype=dtype, count=count, offset=int(r.offset))
            self.calls += 1
            self.handler(self.bases[r.base], int(r.layer), arr.reshape(int(r.rows), r.ne0).copy())

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        """Off: the next graphs run with no split and no callback work (every ask is "no")."""
        self._enabled = bool(on)
        if self._state is not None:
            self._state.enabled = 1 if on else 0

    @property
    def asked(self) -> int:
        """Asks the C gate answered while enabled (0 in the Python fallback)."""
        return int(self._state.asked) if self._state is not None else 0

    @property
    def kind(self) -> str:
        """``c-gate`` when the asks are answered in C, else ``python``."""
        return "c-gate" if self._state is not None else "python"

    def _gate_state(self) -> GateState:
        slots = list(dict.fromkeys(self._defer.values()))
        if len(self.bases) > MAX_BASES or len(slots) > MAX_SLOTS:
            raise ValueError(f"at most {MAX_BASES} names and {MAX_SLOTS} deferred slots")
        st = GateState()
        st.name_offset = _NAME_OFFSET
        st.op_offset = GgmlTensor.op.offset
        st.flush_op = self._flush_op
        st.n_bases = len(self.bases)
        self._slot_names = slots
        for i, base in enumerate(self.bases):
            raw = base.encode()
            if len(raw) >= MAX_BASE_CHARS:
                raise ValueError(f"tensor name {base!r} is too long for the C gate")
            st.base[i].value = raw
            st.slot[i] = slots.index(self._defer[base]) if base in self._defer else -1
        return st

    def _forward(self, ptr: int, ask: bool, _user_data: int) -> bool:
        """Behind the C gate: only the reads arrive here (``ask`` is false)."""
        try:
            if self.pending is not None:
                return False
            st = self._state
            assert st is not None
            queued: list[tuple[str, int, int]] = []
            if st.n_queued and (
                self._flush_on_read or GgmlTensor.from_address(ptr).op == self._flush_op
            ):
                for i in range(len(self._slot_names)):
                    qptr, st.queued[i] = st.queued[i], None
                    q = self._lookup(qptr) if qptr else None
                    if q is not None:
                        queued.append((q[0], q[1], qptr))
                st.n_queued = 0
            return self._deliver_read(ptr, self._lookup(ptr), queued)
        except BaseException as e:  # never across the C boundary; re-raised by raise_pending
            if self.pending is None:
                self.pending = e
            return False

    def _lookup(self, ptr: int) -> tuple[str, int] | None:
        name = ctypes.string_at(ptr + _NAME_OFFSET)
        return self._names[name] if name in self._names else self._parse(name)

    def _parse(self, name: bytes) -> tuple[str, int] | None:
        m = self._pattern.match(name)
        parsed = (m.group(1).decode(), int(m.group(2))) if m else None
        self._names[name] = parsed
        return parsed

    def _deliver_read(
        self, ptr: int, parsed: tuple[str, int] | None, queued: list[tuple[str, int, int]]
    ) -> bool:
        """One read of the scheduler: the deferred tensors it flushes, then the node itself
        when it was asked for directly; False when a handler asked to stop."""
        ok = True
        for base, layer, qptr in queued:
            ok = self._deliver(base, layer, qptr) and ok
        if parsed is not None and parsed[0] not in self._defer:
            ok = self._deliver(parsed[0], parsed[1], ptr) and ok
        return ok

    def _deliver(self, base: str, layer: int, ptr: int) -> bool:
        self.calls += 1
        source = self._inputs.get(base)
        if source is not None:  # the node's input, not the node (a matmul's activations)
            ptr = GgmlTensor.from_address(ptr).src[source]
        return self.handler(base, layer, read_tensor(ptr)) is not False

    def _callback(self, ptr: int, ask: bool, _user_data: int) -> bool:
        if ask and not self._enabled:
            return False
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
            queued: list[tuple[str, int, int]] = []
            if self._queued and (
                self._flush_on_read or GgmlTensor.from_address(ptr).op == self._flush_op
            ):
                queued = list(self._queued.values())  # in the order first seen
                self._queued.clear()
            return self._deliver_read(ptr, parsed, queued)
        except BaseException as e:  # never across the C boundary; re-raised by raise_pending
            if self.pending is None:
                self.pending = e
            return False

    @property
    def unflushed(self) -> int:
        """Deferred tensors seen but not yet delivered (non-zero after a computation means
        no expert matmul followed them)."""
        return int(self._state.n_queued) if self._state is not None else len(self._queued)

    def install(self, params: Any) -> None:
        """Set ``cb_eval`` on llama.cpp context params (``llama_context_params``)."""
        if self._state is not None:
            params.cb_eval = self._c_gate
            params.cb_eval_user_data = ctypes.addressof(self._state)
            return
        params.cb_eval = self._c_callback
        params.cb_eval_user_data = None

    def raise_pending(self) -> None:
        """Re-raise what a handler raised during the last computation, if anything (and
        forget deferred nodes a stopped computation left behind)."""
        if self.pending is not None:
            e, self.pending = self.pending, None
            self._queued.clear()
            if self._state is not None:
                for i in range(MAX_SLOTS):
                    self._state.queued[i] = None
                self._state.n_queued = 0
                self._state.n_rec = self._state.used = self._state.failed = 0
            raise e
