"""Small C helpers compiled at run time with the system's C compiler, once per process.

The eval callback's gate and the read-ahead thread run where Python would cost too much
(thousands of questions per token; a thread that must never wait for the GIL). Each is a
few dozen lines of C kept in its Python module, built into a temporary folder, loaded, and
the folder removed (the mapped library stays). Without a compiler (or with
``MOEPACK_NO_C_GATE=1``, for tests of the fallbacks) ``compile_library`` returns ``None`` and
the callers use their Python versions.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

_BUILT: dict[str, ctypes.CDLL | None] = {}


def compile_library(name: str, source: str, flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """``source`` built as a shared library and loaded (cached by ``name``), or None."""
    if name in _BUILT:
        return _BUILT[name]
    lib: ctypes.CDLL | None = None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is not None and not os.environ.get("MOEPACK_NO_C_GATE"):
        d = Path(tempfile.mkdtemp(prefix=f"moepack-{name}-"))
        try:
            src, so = d / f"{name}.c", d / f"{name}.so"
            src.write_text(source)
            proc = subprocess.run(
                [cc, "-O2", "-shared", "-fPIC", *flags, "-o", str(so), str(src)],
                capture_output=True,
                text=True,
            )
            if proc.returncode == 0 and so.exists():
                lib = ctypes.CDLL(str(so))  # mapped now: the file may go
        except OSError:
            lib = None
        finally:
            shutil.rmtree(d, ignore_errors=True)
    _BUILT[name] = lib
    return lib
