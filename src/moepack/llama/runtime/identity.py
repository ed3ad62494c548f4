"""Is the model file still the one that was opened? (A rewrite or replacement changes it.)

The parent records each shard's identity when it checks the model; the llama.cpp child
compares before loading and after every forward pass, so a file rewritten under a running
generation (whose mapping and prefetch ranges describe the old file) is one error line, not
garbage tokens or a SIGBUS.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ...errors import BadInput


@dataclass(frozen=True)
class FileIdentity:
    """Device, inode, size and modification time of a file."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> FileIdentity:
        st = os.stat(path)
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class ModelChanged(BadInput):
    """The model file was rewritten, replaced or removed while it was in use."""


def check_unchanged(paths: Sequence[Path], identities: Sequence[FileIdentity]) -> None:
    """``ModelChanged`` naming the first shard that is no longer the file that was opened."""
    for path, ident in zip(paths, identities, strict=True):
        try:
            now = FileIdentity.of(path)
        except OSError:
            raise ModelChanged("the model file disappeared while it was running", path) from None
        if now != ident:
            raise ModelChanged(
                "the model file changed since it was opened (size, time or inode differ)", path
            )
