"""Which kind of moepack file an extension names, so that no command writes one kind of file
under another kind's name (GGUF bytes into ``other.moeplan``, plan JSON into ``x.pmxtrace``).

Only extensions that belong to exactly one kind are listed: ``.json``, ``.txt`` and ``.csv`` are
shared by several, and an output named so is accepted for any of them.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import BadInput

GGUF = "GGUF model"
PLAN = "plan"
TRACE = "routing trace"
Q4NX = ".q4nx model"
IMAGE = "PNG image"
SURFACE = "bandwidth surface"
STORE = "expert store"
PRECISION = "precision plan"
# Kinds whose extensions others share (.json, .jsonl, .txt): listed for the outputs' checks,
# which refuse another kind's own extension for them.
NAMES = "names map"
PROMPTS = "prompt file"

KIND_OF_EXTENSION = {
    ".gguf": GGUF,
    ".moeplan": PLAN,
    ".pmxplan": PLAN,
    ".moetrace": TRACE,
    ".pmxtrace": TRACE,
    ".q4nx": Q4NX,
    ".png": IMAGE,
    ".moestore": STORE,
    ".moeprec": PRECISION,
}


def kind_of(path: str | os.PathLike[str]) -> str | None:
    """The kind of file ``path``'s extension names, or None when it names none (or many)."""
    return KIND_OF_EXTENSION.get(Path(path).suffix.lower())


def check_output_kind(path: str | os.PathLike[str], kind: str) -> Path:
    """``BadInput`` when ``path`` ends in another kind's extension than ``kind``, the kind of
    file about to be written there; otherwise ``path`` as a Path."""
    p = Path(path)
    named = kind_of(p)
    if named is not None and named != kind:
        raise BadInput(
            f"the extension {p.suffix!r} is for a {named}, but this writes a {kind} "
            "(name the output for what it holds)",
            p,
        )
    return p
