"""One exception family for everything a user can get wrong.

The CLI turns a ``MoepackError`` into a single line on stderr and its ``exit_code``:
2 for bad input (the default), 1 for a check that ran and failed. Messages name the file
and the problem, e.g. ``model.gguf: tensor 'blk.0.ffn_up_exps.weight' data ends at 9000,
past the end of the file (8192 bytes)``.
"""

from __future__ import annotations

import os


class MoepackError(Exception):
    """Bad input or an environment problem the user can fix. Exit code 2."""

    exit_code = 2

    def __init__(self, message: str, path: str | os.PathLike[str] | None = None) -> None:
        self.path = os.fspath(path) if path is not None else None
        self.message = message
        super().__init__(f"{self.path}: {message}" if self.path else message)


class BadInput(MoepackError):
    """A file or argument that is malformed, inconsistent, or for another model."""


class VerificationFailed(MoepackError):
    """A verification ran to a verdict and the verdict is "different". Exit code 1."""

    exit_code = 1
