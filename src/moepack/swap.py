"""Two names of one folder swapped in one step: ``renameat2(RENAME_EXCHANGE)``.

A folder output (an NPU pack) is built whole beside its destination and switched in by
exchanging the two names, so that at every instant the destination is the old folder or the
new one, never a mix; the old one, now at the staging name, is removed after. Python has no
binding for ``renameat2``; it is called through libc (glibc 2.28+) or, where libc lacks it,
the raw system call. ``ExchangeUnsupported`` says the filesystem (or kernel) refuses the
flag, so the caller can fall back to a scheme of single renames.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform
from pathlib import Path

AT_FDCWD = -100
RENAME_EXCHANGE = 1 << 1
# renameat2's system call number where libc has no wrapper
_SYSCALL = {"x86_64": 316, "aarch64": 276, "riscv64": 276, "ppc64le": 357, "s390x": 347}
_REFUSED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}
_FORCE_FALLBACK = "MOEPACK_NO_RENAME_EXCHANGE"
"""Set (to anything) to take the single-rename scheme, as on a filesystem that refuses the
exchange: how the fallback is tested on a filesystem that has it."""


class ExchangeUnsupported(OSError):
    """The filesystem or kernel cannot exchange two names atomically."""


_libc: ctypes.CDLL | None = None


def _call(a: bytes, b: bytes) -> int:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = getattr(_libc, "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return int(fn(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE))
    number = _SYSCALL.get(platform.machine())
    if number is None:
        ctypes.set_errno(errno.ENOSYS)
        return -1
    syscall = _libc.syscall
    syscall.restype = ctypes.c_long
    return int(
        syscall(
            ctypes.c_long(number),
            ctypes.c_int(AT_FDCWD),
            ctypes.c_char_p(a),
            ctypes.c_int(AT_FDCWD),
            ctypes.c_char_p(b),
            ctypes.c_uint(RENAME_EXCHANGE),
        )
    )


def exchange(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> None:
    """Swap what the names ``a`` and ``b`` stand for, atomically; both must exist.
    ``ExchangeUnsupported`` where the filesystem refuses, ``OSError`` for anything else."""
    if os.environ.get(_FORCE_FALLBACK):
        raise ExchangeUnsupported(errno.EINVAL, "RENAME_EXCHANGE turned off", str(a))
    if _call(os.fsencode(Path(a)), os.fsencode(Path(b))) == 0:
        return
    err = ctypes.get_errno()
    if err in _REFUSED:
        raise ExchangeUnsupported(err, os.strerror(err), str(a))
    raise OSError(err, os.strerror(err), str(a), None, str(b))
