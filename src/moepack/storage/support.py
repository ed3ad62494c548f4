"""Which read modes a filesystem serves, answered by trying them on a real file."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInput
from ..safeio import os_error_text, scratch_file
from .corpus import CORPUS_NAME, check_directory, is_corpus, unwritable
from .linux import DioAlign
from .modes import Mode, ModeUnsupported, open_file


@dataclass
class ModeSupport:
    file: str
    unsupported: dict[str, str | None]  # mode -> why not (None: served); empty when untested
    dio_align: DioAlign | None
    untested: str | None = None  # why the modes could not be tried (a read-only folder)


def _try(path: Path) -> ModeSupport:
    why: dict[str, str | None] = {}
    align = None
    for m in Mode:
        try:
            with open_file(path, m) as f:
                why[m.value] = None
                align = f.align or align
        except ModeUnsupported as e:
            why[m.value] = e.message
    return ModeSupport(str(path), why, align)


def mode_support(path: str | os.PathLike[str]) -> ModeSupport:
    """Try every mode on ``path``; for a folder, on its corpus or a 1 MiB temporary file.
    A folder where no file can be made (read-only) and without a corpus leaves the modes
    untested, with the reason, rather than failing."""
    p = Path(path)
    if p.is_file():
        return _try(p)
    d = check_directory(p, writable=False)
    if is_corpus(d / CORPUS_NAME):
        return _try(d / CORPUS_NAME)
    why = unwritable(d)
    if why:
        return ModeSupport(str(d), {}, None, f"{why}: no file to try them on")
    try:
        with scratch_file(d, "moepack-modes") as tmp:
            tmp.write_bytes(os.urandom(1 << 20))
            found = _try(tmp)
            found.file = f"{d} (a temporary file)"
            return found
    except OSError as e:
        raise BadInput(f"cannot try the modes here: {os_error_text(e)}", d) from None
