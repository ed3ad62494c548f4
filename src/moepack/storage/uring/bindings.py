"""Checks of the PyPI io_uring bindings, each in a subprocess.

A binding built for CPU features this machine lacks dies with SIGILL the moment it creates a
ring (PyPI ``liburing`` does exactly that on AVX2-only CPUs); a subprocess turns that into a
report instead of taking moepack down. The engines use ``ring.Ring`` (ctypes over the raw
syscalls); these checks say whether a maintained binding could replace it here.
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
from dataclasses import dataclass

from .ring import ring_unavailable_reason

# Each snippet prints "ok <version>" when the binding creates a ring; anything else is a failure.
_CHECKS: dict[str, str] = {
    "liburing": (
        "import importlib.metadata as m, liburing\n"
        "r = liburing.Ring()\n"
        "print('ok', m.version('liburing'))\n"
    ),
    "pyuring": (
        "import importlib.metadata as m, pyuring\n"
        "ctx = [getattr(pyuring, n) for n in ('UringCtx', 'Ring', 'IoUring') if hasattr(pyuring, n)]\n"
        "assert ctx, 'no ring class found in pyuring'\n"
        "r = ctx[0]()\n"
        "print('ok', m.version('pyuring'))\n"
    ),
}

# The module each binding installs: one that is not installed needs no child to say so.
_MODULES = {"liburing": "liburing", "pyuring": "pyuring"}


@dataclass(frozen=True)
class BindingCheck:
    name: str
    usable: bool
    detail: str


def _explain(rc: int, out: str, err: str) -> str:
    if rc < 0:
        sig = signal.Signals(-rc).name
        if sig == "SIGILL":
            return (
                "killed by SIGILL (illegal instruction) creating a ring: the binary was built "
                "for CPU features this CPU lacks"
            )
        return f"killed by {sig} creating a ring"
    last = (err.strip().splitlines() or [out.strip()])[-1]
    if "ModuleNotFoundError" in last or "No module named" in last:
        return "not installed"
    return last[:200]


def check_bindings(timeout: float = 30.0) -> list[BindingCheck]:
    """The PyPI bindings (each one installed tried in a subprocess), then the built-in
    ctypes ring."""
    out = []
    for name, code in _CHECKS.items():
        module = _MODULES.get(name)
        if module is not None and importlib.util.find_spec(module) is None:
            out.append(BindingCheck(name, False, "not installed"))
            continue
        try:
            p = subprocess.run(
                [sys.executable, "-c", code],
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            out.append(BindingCheck(name, False, f"no answer within {timeout:g} s"))
            continue
        if p.returncode == 0 and p.stdout.startswith("ok"):
            out.append(BindingCheck(name, True, f"creates a ring (version {p.stdout.split()[1]})"))
        else:
            out.append(BindingCheck(name, False, _explain(p.returncode, p.stdout, p.stderr)))
    reason = ring_unavailable_reason()
    out.append(
        BindingCheck(
            "ctypes (built in)",
            reason is None,
            reason or "io_uring_setup/io_uring_enter through ctypes; used by the uring engines",
        )
    )
    return out
