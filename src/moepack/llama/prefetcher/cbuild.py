"""The prefetcher's C, built once per source and compiler into the user's cache directory.

The eval callback's gate and the read-ahead thread run where Python would cost too much
(thousands of questions per token; a thread that must never wait for the GIL). Their sources
are real files beside this module (``csrc/gate.c``, ``csrc/stream.c``), compiled with the
system's C compiler, warnings on, into ``$MOEPACK_CACHE_DIR`` (else
``$XDG_CACHE_HOME/moepack``, else ``~/.cache/moepack``) under ``c/``, named by a hash of the
source, the flags and the compiler, so a process finds the library built and loads it instead
of compiling it again (each ``run`` used to pay the compile at start). A build is written
beside its final name and switched into place, so processes building at once never load half
a library. Where the cache cannot be written the library is built into a temporary folder,
loaded, and the folder removed (the mapped library stays). Without a compiler (or with
``MOEPACK_NO_C_GATE=1``, for tests of the fallbacks) ``compile_library`` returns ``None`` and
the callers use their Python versions.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from ...cachedir import cache_dir

CSRC = Path(__file__).with_name("csrc")
# every build has these on; a test holds the sources to them with -Werror
WARNINGS = ("-Wall", "-Wextra", "-Wpedantic")
BASE_FLAGS = ("-std=gnu11", "-O3", "-shared", "-fPIC")

_LOADED: dict[str, ctypes.CDLL | None] = {}


def compiler() -> str | None:
    """The C compiler to use (``CC``, else ``cc`` or ``gcc`` on the path), or None."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _compiler_identity(cc: str) -> str:
    """The compiler's resolved path with its size and time: an upgrade names a new build
    (cheaper than asking ``cc --version`` in every process)."""
    path = shutil.which(cc) or cc
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return path
    return f"{real}:{st.st_size}:{st.st_mtime_ns}"


def build_flags(defines: Mapping[str, int], flags: tuple[str, ...]) -> list[str]:
    """The compiler's arguments but for the file names."""
    return [*BASE_FLAGS, *WARNINGS, *flags, *(f"-D{k}={v}" for k, v in sorted(defines.items()))]


def library_name(name: str, cc: str, args: list[str]) -> str:
    """``name-<hash>.so``: the hash of the source, the arguments and the compiler."""
    h = hashlib.sha256((CSRC / f"{name}.c").read_bytes())
    h.update("\0".join([_compiler_identity(cc), *args]).encode())
    return f"{name}-{h.hexdigest()[:16]}.so"


def compile_to(
    cc: str, source: Path, args: list[str], out: Path
) -> subprocess.CompletedProcess[str]:
    """One compiler run: ``source`` into the shared library ``out``."""
    return subprocess.run(
        [cc, *args, "-o", str(out), str(source)], capture_output=True, text=True, check=False
    )


def _build_cached(cc: str, name: str, args: list[str]) -> Path | None:
    """The library in the cache, built there first if it is not; None if the cache cannot be
    written or the build fails."""
    folder = cache_dir() / "c"
    target = folder / library_name(name, cc, args)
    if target.exists():
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
        os.close(fd)
    except OSError:
        return None
    try:
        proc = compile_to(cc, CSRC / f"{name}.c", args, Path(tmp))
        if proc.returncode != 0:
            return None
        os.replace(tmp, target)
        return target
    except OSError:
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build_temporary(cc: str, name: str, args: list[str]) -> ctypes.CDLL | None:
    """Built into a temporary folder and loaded; the folder goes (the mapping stays)."""
    d = Path(tempfile.mkdtemp(prefix=f"moepack-{name}-"))
    try:
        so = d / f"{name}.so"
        proc = compile_to(cc, CSRC / f"{name}.c", args, so)
        return ctypes.CDLL(str(so)) if proc.returncode == 0 and so.exists() else None
    except OSError:
        return None
    finally:
        shutil.rmtree(d, ignore_errors=True)


def compile_library(
    name: str, *, defines: Mapping[str, int] | None = None, flags: tuple[str, ...] = ()
) -> ctypes.CDLL | None:
    """``csrc/<name>.c`` built (or found built) and loaded, once per process, or None."""
    if name in _LOADED:
        return _LOADED[name]
    lib: ctypes.CDLL | None = None
    cc = compiler()
    if cc is not None and not os.environ.get("MOEPACK_NO_C_GATE"):
        args = build_flags(defines or {}, flags)
        built = _build_cached(cc, name, args)
        if built is not None:
            try:
                lib = ctypes.CDLL(str(built))
            except OSError:  # a damaged cache entry: build afresh where nothing else looks
                lib = None
        if lib is None:
            lib = _build_temporary(cc, name, args)
    _LOADED[name] = lib
    return lib
