"""Routing spooled to raw files as a llama.cpp child computes, read back as memory maps.

A capture or a traced run appends each decode call's routing (ids ``[tokens, layers, k]``,
optionally router weights and token ids) to one raw file per array, flushed after every call
so the spool always ends on a token boundary; the parent then maps the files and writes the
trace in bounded chunks. Memory never grows with the number of tokens routed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import BinaryIO

import numpy as np


class SpoolFiles:
    """``<name>.bin`` per array in ``folder``, appended to together (child side).

    ``resume``: name -> the bytes of that file to keep (a worker that takes over a spool from
    one that died: what it wrote past the last whole unit the parent knows of is cut off,
    and the new worker appends after it); None: the files start empty."""

    def __init__(
        self,
        files: ExitStack,
        folder: Path,
        names: Sequence[str],
        resume: Mapping[str, int] | None = None,
    ) -> None:
        self._fh: dict[str, BinaryIO] = {}
        for name in names:
            path = folder / f"{name}.bin"
            with ExitStack() as one:
                fh: BinaryIO
                if resume is None:
                    fh = one.enter_context(open(path, "wb"))
                else:
                    path.touch()
                    fh = one.enter_context(open(path, "r+b"))
                    fh.truncate(int(resume.get(name, 0)))
                    fh.seek(0, 2)
                self._fh[name] = fh
                files.push(one.pop_all())

    def append(self, **arrays: np.ndarray) -> None:
        """One decode call's arrays (every spooled name), written and flushed."""
        for name, fh in self._fh.items():
            fh.write(np.ascontiguousarray(arrays[name]).tobytes())
        for fh in self._fh.values():
            fh.flush()


def spooled(folder: Path, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A read-only memory map of a spooled array (parent side)."""
    return np.memmap(folder / f"{name}.bin", dtype=dtype, mode="r", shape=shape)
