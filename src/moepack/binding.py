"""What ties an input made for a model (a trace, a plan) to the model it is used on.

Native files record the model's fingerprint, so using one on another model is an error. The
peer's ``.pmxtrace`` and ``.pmxplan`` and the route CSV record none: they fit any model of the
same shape, and moepack cannot tell the right model from a wrong one. That is never silent:
every use says so in one warning line, and outputs record which of the two the binding rests on.
"""

from __future__ import annotations

import os

from .errors import one_line

FINGERPRINT = "fingerprint"  # the input recorded the model's fingerprint and it matched
SHAPE = "shape"  # the input recorded no fingerprint: only the shape was checked


def basis(fingerprint: str | None) -> str:
    """``FINGERPRINT`` when an input carried a fingerprint (that was checked), else ``SHAPE``."""
    return FINGERPRINT if fingerprint else SHAPE


def shape_only_warning(
    what: str, path: str | os.PathLike[str] | None, model: str | os.PathLike[str]
) -> str:
    """The one line that says an input was bound to ``model`` by its shape alone."""
    where = f"{os.fspath(path)}: " if path is not None else ""
    return one_line(
        f"{where}this {what} records no model fingerprint, so it was checked against "
        f"{os.fspath(model)} by shape only (a different model of the same shape would pass too)"
    )


def shape_only_warnings(
    what: str,
    fingerprint: str | None,
    path: str | os.PathLike[str] | None,
    model: str | os.PathLike[str],
    recorded: object = None,
) -> list[str]:
    """``[shape_only_warning(...)]`` when an input used on ``model`` rests on its shape alone:
    it carries no ``fingerprint``, or a binding made earlier ``recorded`` ``SHAPE`` (a trace
    stamped with the model's fingerprint by ``bound_to`` remembers how it was bound); else
    ``[]``."""
    if fingerprint and recorded != SHAPE:
        return []
    return [shape_only_warning(what, path, model)]
