"""Wording for a file the NPU commands cannot open, as the rest of moepack words it."""

from __future__ import annotations

import errno

_WORDS = {
    errno.ENOENT: "no such file",
    errno.ENOTDIR: "no such file (a part of the path is not a folder)",
    errno.EISDIR: "is a folder, not a file",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}


def open_problem(e: OSError) -> str:
    """``no such file`` rather than ``No such file or directory``; other errors as the OS
    says them, lower-cased like every other message."""
    if e.errno in _WORDS:
        return _WORDS[e.errno]
    text = e.strerror or str(e)
    return text[:1].lower() + text[1:]
