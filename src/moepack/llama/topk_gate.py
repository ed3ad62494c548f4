"""A C gate in front of the Python eval callback: only ``ffn_moe_topk-<il>`` reaches Python.

ggml's scheduler asks the eval callback about *every* graph node, ~45 per layer per token. A
Python ctypes callback costs microseconds per call, which on a cached model was 10–15 % of
decode time before any prefetching happened. This gate is a few lines of C, compiled once per
process with the system's C compiler: it answers the asks itself (anchored name match on the
tensor's ``name`` field), forwards only the matched nodes to the Python callback, and can be
switched off between tokens (``enabled``) so that a token whose experts are all resident runs
with no callback work and no graph splits at all.

Without a C compiler the same gate runs in Python (correct, slower); ``kind`` says which one
runs.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from .evalcb import GgmlTensor

_SOURCE = r"""
#include <stdbool.h>
#include <stddef.h>
#include <string.h>

typedef bool (*forward_fn)(void * t, bool ask, void * ud);

struct gate {
    volatile int enabled;
    int name_offset;
    forward_fn forward;
    long long asked;
    long long forwarded;
};

static int is_topk(const char * n) {
    static const char prefix[] = "ffn_moe_topk-";
    if (strncmp(n, prefix, sizeof(prefix) - 1) != 0) return 0;
    n += sizeof(prefix) - 1;
    if (*n == 0) return 0;
    for (; *n; n++) if (*n < '0' || *n > '9') return 0;
    return 1;
}

bool moepack_topk_gate(void * t, bool ask, void * ud) {
    struct gate * g = (struct gate *) ud;
    if (ask) {
        g->asked++;
        return g->enabled && is_topk((const char *) t + g->name_offset);
    }
    g->forwarded++;
    return g->forward(t, ask, ud);
}
"""


class _Gate(ctypes.Structure):
    _fields_ = [
        ("enabled", ctypes.c_int),
        ("name_offset", ctypes.c_int),
        ("forward", ctypes.c_void_p),
        ("asked", ctypes.c_longlong),
        ("forwarded", ctypes.c_longlong),
    ]


def _compile() -> ctypes.CDLL | None:
    """The gate as a shared library, or ``None`` when no C compiler works here."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    d = Path(tempfile.mkdtemp(prefix="moepack-gate-"))
    try:
        src, lib = d / "gate.c", d / "gate.so"
        src.write_text(_SOURCE)
        proc = subprocess.run(
            [cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0 or not lib.exists():
            return None
        return ctypes.CDLL(str(lib))  # mapped now: the file can go
    except OSError:
        return None
    finally:
        shutil.rmtree(d, ignore_errors=True)


class TopkGate:
    """Wraps an ``EvalCallback`` for ``ffn_moe_topk``; installs the C gate when it compiles.

    Duck-types what ``LlamaSession`` needs from a callback: ``install`` and ``raise_pending``.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._lib = _compile()
        self.kind = "c-gate" if self._lib is not None else "python"
        self._gate = _Gate(1, GgmlTensor.name.offset, 0, 0, 0)  # type: ignore[attr-defined]
        if self._lib is not None:
            self._gate.forward = ctypes.cast(inner._c_callback, ctypes.c_void_p).value

    @property
    def enabled(self) -> bool:
        return bool(self._gate.enabled)

    @enabled.setter
    def enabled(self, on: bool) -> None:
        """Off: the next graphs run with no split and no Python call (C gate only)."""
        self._gate.enabled = 1 if on else 0

    @property
    def asked(self) -> int:
        return int(self._gate.asked)

    def _python_gate(self, ptr: int, ask: bool, user_data: int) -> bool:
        """The fallback: the same switch in Python (each ask still costs a Python call)."""
        if ask and not self._gate.enabled:
            return False
        return bool(self.inner._callback(ptr, ask, user_data))

    def install(self, params: Any) -> None:
        import llama_cpp

        if self._lib is None:
            self._py_callback = llama_cpp.ggml_backend_sched_eval_callback(self._python_gate)
            params.cb_eval = self._py_callback
            params.cb_eval_user_data = None
            return

        fn = ctypes.cast(self._lib.moepack_topk_gate, ctypes.c_void_p).value
        assert fn is not None
        params.cb_eval = llama_cpp.ggml_backend_sched_eval_callback(fn)
        params.cb_eval_user_data = ctypes.addressof(self._gate)

    def raise_pending(self) -> None:
        self.inner.raise_pending()
