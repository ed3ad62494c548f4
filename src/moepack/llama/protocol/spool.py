"""Routing spooled to raw files as a llama.cpp child computes, read back as memory maps.

A capture or a traced run appends each decode call's routing (ids ``[tokens, layers, k]``,
optionally router weights and token ids) to one raw file per array, flushed after every call
so the spool always ends on a token boundary; the parent then maps the files and writes the
trace in bounded chunks. Memory never grows with the number of tokens routed.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import BinaryIO

import numpy as np


class SpoolFiles:
    """``<name>.bin`` per array in ``folder``, appended to together (child side)."""

    def __init__(self, files: ExitStack, folder: Path, names: Sequence[str]) -> None:
        self._fh: dict[str, BinaryIO] = {}
        for name in names:
            with ExitStack() as one:
                self._fh[name] = one.enter_context(open(folder / f"{name}.bin", "wb"))
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
