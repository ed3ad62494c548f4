"""An on/off switch in front of an eval callback, so a pass with nothing to do costs nothing.

The prefetcher needs llama.cpp's eval callback only while some expert bytes may be missing.
With the switch off, the scheduler's asks are answered "no" in C before any other code runs:
no graph split, no Python call, llama.cpp computes as if no callback were set. With it on,
every call goes to the callback behind it (``EvalCallback``: its own C gate, or Python).
It is a few lines of C compiled once per process with the system's C compiler; without one
the switch runs in Python (same results, each ask then costs a Python call); ``kind`` says
which.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

_SOURCE = r"""
#include <stdbool.h>

typedef bool (*eval_fn)(void * t, bool ask, void * ud);

struct sw {
    volatile int enabled;
    eval_fn next;
    void * next_ud;
    long long asked;
};

bool moepack_callback_switch(void * t, bool ask, void * ud) {
    struct sw * s = (struct sw *) ud;
    if (ask) {
        if (!s->enabled) return false;
        s->asked++;
    }
    return s->next(t, ask, s->next_ud);
}
"""


class _Switch(ctypes.Structure):
    _fields_ = [
        ("enabled", ctypes.c_int),
        ("next", ctypes.c_void_p),
        ("next_ud", ctypes.c_void_p),
        ("asked", ctypes.c_longlong),
    ]


def _compile() -> ctypes.CDLL | None:
    """The switch as a shared library, or ``None`` when no C compiler works here."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    d = Path(tempfile.mkdtemp(prefix="moepack-switch-"))
    try:
        src, lib = d / "switch.c", d / "switch.so"
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


class CallbackSwitch:
    """Wraps an ``EvalCallback`` (anything with ``install`` and ``raise_pending``).

    Duck-types what ``LlamaSession`` needs from a callback.
    """

    def __init__(self, inner: Any) -> None:
        import llama_cpp

        self.inner = inner
        self._lib = _compile()
        self.kind = "c-switch" if self._lib is not None else "python"
        self._switch = _Switch(1, None, None, 0)
        # What the inner callback installs (its C gate or its Python function) comes next.
        probe = llama_cpp.llama_context_default_params()
        inner.install(probe)
        self._next = probe.cb_eval  # keeps the inner ctypes function alive with us
        self._switch.next = ctypes.cast(probe.cb_eval, ctypes.c_void_p).value
        self._switch.next_ud = probe.cb_eval_user_data
        self._py: Any = None
        if self._lib is None:
            self._py = llama_cpp.ggml_backend_sched_eval_callback(self._python_switch)

    @property
    def enabled(self) -> bool:
        return bool(self._switch.enabled)

    @enabled.setter
    def enabled(self, on: bool) -> None:
        """Off: the next graphs run with no split and no callback work."""
        self._switch.enabled = 1 if on else 0

    @property
    def asked(self) -> int:
        """Asks passed on to the callback behind (C switch only)."""
        return int(self._switch.asked)

    def _python_switch(self, ptr: int, ask: bool, user_data: int) -> bool:
        if ask and not self._switch.enabled:
            return False
        return bool(self._next(ptr, ask, self._switch.next_ud))

    def install(self, params: Any) -> None:
        import llama_cpp

        if self._lib is None:
            params.cb_eval = self._py
            params.cb_eval_user_data = None
            return
        fn = ctypes.cast(self._lib.moepack_callback_switch, ctypes.c_void_p).value
        assert fn is not None
        self._c = llama_cpp.ggml_backend_sched_eval_callback(fn)
        params.cb_eval = self._c
        params.cb_eval_user_data = ctypes.addressof(self._switch)

    def raise_pending(self) -> None:
        self.inner.raise_pending()
