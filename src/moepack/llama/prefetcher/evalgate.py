"""The eval callback's asks answered in C, so Python runs only for the tensors it reads.

ggml's scheduler asks the callback about every graph node (~70 per MoE layer per token). In
Python each ask costs microseconds of interpreter work: profiled on an 8-layer model that was
about a tenth of decode time. This gate is a few lines of C (``csrc/gate.c``), built once by ``cbuild``
with the system's C compiler: it does the anchored ``<base>-<digits>`` match on the tensor's
``name`` field, remembers deferred nodes in slots and asks for the layer's ``MUL_MAT_ID``
(``EvalCallback``'s two modes), and forwards only the reads to Python. In record mode it
also makes the deferred reads itself (host memory, strides honoured) into a buffer Python
drains after the decode call, so a capture runs no Python inside llama.cpp's compute. Its
``enabled`` flag is an on/off switch: off, every ask is answered "no" before anything else
runs, so llama.cpp computes as if no callback were set (what ``moepack run`` wants while
the whole file is cached). Without a working C compiler ``compile_gate`` returns ``None`` and ``EvalCallback`` answers the asks itself.
"""

from __future__ import annotations

import ctypes

from .cbuild import compile_library

MAX_BASES = 16
MAX_SLOTS = 8
MAX_BASE_CHARS = 64
MAX_RECORDS = 1 << 16  # deferred reads recorded per decode call, at most


class Record(ctypes.Structure):
    """``struct rec``: one deferred tensor copied in record mode."""

    _fields_ = [
        ("base", ctypes.c_int32),
        ("layer", ctypes.c_int32),
        ("type", ctypes.c_int32),
        ("ne0", ctypes.c_int32),
        ("rows", ctypes.c_int64),
        ("offset", ctypes.c_int64),
    ]


class GateState(ctypes.Structure):
    """``struct gate`` of the C source: the bases, their slots (-1: asked for directly), the
    deferred pointers waiting for the flush op, and the Python function reads go to."""

    _fields_ = [
        ("name_offset", ctypes.c_int),
        ("op_offset", ctypes.c_int),
        ("flush_op", ctypes.c_int),
        ("n_bases", ctypes.c_int),
        ("slot", ctypes.c_int * MAX_BASES),
        ("base", (ctypes.c_char * MAX_BASE_CHARS) * MAX_BASES),
        ("queued", ctypes.c_void_p * MAX_SLOTS),
        ("queued_base", ctypes.c_int * MAX_SLOTS),
        ("n_queued", ctypes.c_int),
        ("forward", ctypes.c_void_p),
        ("asked", ctypes.c_longlong),
        ("record", ctypes.c_int),
        ("ne_offset", ctypes.c_int),
        ("nb_offset", ctypes.c_int),
        ("data_offset", ctypes.c_int),
        ("buffer_offset", ctypes.c_int),
        ("is_host", ctypes.c_void_p),
        ("buf", ctypes.c_void_p),
        ("cap", ctypes.c_int64),
        ("used", ctypes.c_int64),
        ("recs", ctypes.c_void_p),
        ("n_rec", ctypes.c_int),
        ("max_rec", ctypes.c_int),
        ("failed", ctypes.c_int),
        ("enabled", ctypes.c_int),
        ("hook", ctypes.c_void_p),
        ("hook_ctx", ctypes.c_void_p),
        ("hook_base", ctypes.c_int),
        ("hook_forward", ctypes.c_int),
    ]


def compile_gate() -> ctypes.CDLL | None:
    """The gate as a loaded shared library (once per process), or ``None`` without a C
    compiler (``MOEPACK_NO_C_GATE=1`` also says none, for tests of the fallback)."""
    limits = {"MAX_BASES": MAX_BASES, "MAX_SLOTS": MAX_SLOTS, "MAX_BASE_CHARS": MAX_BASE_CHARS}
    return compile_library("gate", defines=limits)
