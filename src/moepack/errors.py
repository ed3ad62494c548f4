"""One exception family for everything a user can get wrong.

The CLI turns a ``MoepackError`` into a single line on stderr and its ``exit_code``:
2 for bad input (the default), 1 for a check that ran and failed. Messages name the file
and the problem, e.g. ``model.gguf: tensor 'blk.0.ffn_up_exps.weight' data ends at 9000,
past the end of the file (8192 bytes)``. A message names an argument the way a caller of the
library passes it, the parameter in backticks (```measure_tokens` must be at least 1``); the
command line shows the flag that sets it instead (``moepack.cli.flags``).
"""

from __future__ import annotations

import os
import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def one_line(text: str) -> str:
    """``text`` with control characters (a newline in a file name, an escape sequence) shown
    as escapes, so that an error stays one line and cannot drive the terminal."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


class MoepackError(Exception):
    """Bad input or an environment problem the user can fix. Exit code 2."""

    exit_code = 2

    def __init__(self, message: str, path: str | os.PathLike[str] | None = None) -> None:
        self.path = os.fspath(path) if path is not None else None
        self.message = message
        shown = one_line(message)
        super().__init__(f"{one_line(self.path)}: {shown}" if self.path else shown)


class BadInput(MoepackError):
    """A file or argument that is malformed, inconsistent, or for another model."""


class VerificationFailed(MoepackError):
    """A verification ran to a verdict and the verdict is "different". Exit code 1."""

    exit_code = 1
