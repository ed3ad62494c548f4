"""The eval callback's asks answered in C, so Python runs only for the tensors it reads.

ggml's scheduler asks the callback about every graph node (~70 per MoE layer per token). In
Python each ask costs microseconds of interpreter work: profiled on an 8-layer model that was
about a tenth of decode time. This gate is a few lines of C, compiled once per process with
the system's C compiler: it does the anchored ``<base>-<digits>`` match on the tensor's
``name`` field, remembers deferred nodes in slots and asks for the layer's ``MUL_MAT_ID``
(``EvalCallback``'s two modes), and forwards only the reads to Python. Without a working
C compiler ``compile_gate`` returns ``None`` and ``EvalCallback`` answers the asks itself.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

MAX_BASES = 16
MAX_SLOTS = 8
MAX_BASE_CHARS = 64

_SOURCE = r"""
#include <stdbool.h>
#include <string.h>

#define MAX_BASES %(bases)d
#define MAX_SLOTS %(slots)d
#define MAX_BASE_CHARS %(chars)d

typedef bool (*forward_fn)(void * t, bool ask, void * ud);

struct gate {
    int name_offset;
    int op_offset;
    int flush_op;
    int n_bases;
    int slot[MAX_BASES];
    char base[MAX_BASES][MAX_BASE_CHARS];
    void * queued[MAX_SLOTS];
    int n_queued;
    forward_fn forward;
    long long asked;
};

static int matches(const char * name, const char * base) {
    size_t n = strlen(base);
    if (strncmp(name, base, n) != 0 || name[n] != '-' || name[n + 1] == 0) return 0;
    for (name += n + 1; *name; name++) if (*name < '0' || *name > '9') return 0;
    return 1;
}

bool moepack_eval_gate(void * t, bool ask, void * ud) {
    struct gate * g = (struct gate *) ud;
    if (!ask) return g->forward(t, ask, ud);
    g->asked++;
    const char * name = (const char *) t + g->name_offset;
    for (int i = 0; i < g->n_bases; i++) {
        if (matches(name, g->base[i])) {
            if (g->slot[i] < 0) return true;
            if (g->queued[g->slot[i]] == 0) g->n_queued++;
            g->queued[g->slot[i]] = t;
            return false;
        }
    }
    return g->n_queued > 0 && *(const int *) ((const char *) t + g->op_offset) == g->flush_op;
}
"""


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
        ("n_queued", ctypes.c_int),
        ("forward", ctypes.c_void_p),
        ("asked", ctypes.c_longlong),
    ]


_COMPILED: list[ctypes.CDLL | None] = []


def compile_gate() -> ctypes.CDLL | None:
    """The gate as a loaded shared library (once per process), or ``None`` without a C
    compiler (``MOEPACK_NO_C_GATE=1`` also says none, for tests of the fallback)."""
    if _COMPILED:
        return _COMPILED[0]
    lib: ctypes.CDLL | None = None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is not None and not os.environ.get("MOEPACK_NO_C_GATE"):
        d = Path(tempfile.mkdtemp(prefix="moepack-gate-"))
        try:
            src, so = d / "gate.c", d / "gate.so"
            values = {"bases": MAX_BASES, "slots": MAX_SLOTS, "chars": MAX_BASE_CHARS}
            src.write_text(_SOURCE % values)
            proc = subprocess.run(
                [cc, "-O2", "-shared", "-fPIC", "-o", str(so), str(src)],
                capture_output=True,
                text=True,
            )
            if proc.returncode == 0 and so.exists():
                lib = ctypes.CDLL(str(so))  # mapped now: the file may go
        except OSError:
            lib = None
        finally:
            shutil.rmtree(d, ignore_errors=True)
    _COMPILED.append(lib)
    return lib
