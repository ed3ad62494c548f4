"""What ``run``, ``serve`` and ``streaming_llama`` run a model with when no flag says, and what
``fit`` estimates: one rule, chosen by measurement at the size people run
(``benchmarks/bench_real.py``; the figures are in ``docs/run.md``).

- The model fits in the memory available (its file and what the context needs, with room):
  llama.cpp's own defaults, its repacked kernels included.
- It does not: the expert prefetcher with the pager (userfaultfd over llama.cpp's mapping,
  ``O_DIRECT`` reads, a hard budget of the memory available less a margin). At 17 GB with
  12 GiB left it decoded 2.6-3.3x the page-cache prefetcher and over 10x llama.cpp's own mmap.
- Where userfaultfd is refused: the page-cache prefetcher (the streamer says why in one
  warning).

``--prefetch`` / ``--no-prefetch`` (``StreamOptions`` / ``None``) choose otherwise; ``AutoStream``
carries the flags' options to use where streaming is chosen.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ...checkpoint.model import MoeModel
from ...storage.linux import mem_available
from ..prefetcher.streamer import MARGIN, StreamOptions, wants_pager

GIB = 1 << 30


@dataclass(frozen=True)
class AutoStream:
    """Stream with ``options`` where the model does not fit in the memory available, else run
    llama.cpp's defaults (the choice ``choose_streaming`` makes)."""

    options: StreamOptions = field(default_factory=StreamOptions)


Prefetch = StreamOptions | AutoStream | None
"""What a caller asks of the prefetcher: always (``StreamOptions``), never (``None``), or
where the model needs it (``AutoStream``, the default)."""


@dataclass(frozen=True)
class StreamingChoice:
    """The prefetcher chosen for one model (None: llama.cpp alone), and the line saying so."""

    prefetch: StreamOptions | None
    engine: str  # "llama.cpp", "pager" or "page cache"
    file_bytes: int
    available: int
    reason: str
    automatic: bool = True  # chosen here, not asked for

    @property
    def note(self) -> str | None:
        """The one line ``run`` and ``serve`` show when they chose to stream unasked."""
        if self.prefetch is None or not self.automatic:
            return None
        how = (
            "moepack's pager (O_DIRECT reads, a hard budget)"
            if self.engine == "pager"
            else "the page-cache prefetcher"
        )
        return (
            f"{self.reason}: the experts stream through {how}; `no_prefetch` runs llama.cpp's "
            "own mmap, `pager` off the page cache"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "file_bytes": self.file_bytes,
            "available_bytes": self.available,
            "reason": self.reason,
            "automatic": self.automatic,
        }


def fits(file_bytes: int, available: int, reserve: int = 0) -> bool:
    """Whether a model of ``file_bytes`` runs from memory: the file and ``reserve`` (the
    context's own memory) within what is available, less the margin the live cache leaves."""
    room = available - max(MARGIN, available // 20)
    return file_bytes + reserve <= room


def choose_streaming(
    model: str | os.PathLike[str],
    prefetch: Prefetch,
    *,
    available: int | None = None,
    reserve: int = 0,
) -> StreamingChoice:
    """The prefetcher ``prefetch`` resolves to on ``model`` here (``available``: the memory
    available, measured now when None; ``reserve``: bytes the context needs beside the
    weights)."""
    with MoeModel(model) as m:
        size = m.file_bytes
    free = mem_available() if available is None else available
    if prefetch is None:
        return StreamingChoice(None, "llama.cpp", size, free, "asked for no prefetcher", False)
    if isinstance(prefetch, StreamOptions):
        engine = _engine(prefetch, size, free)
        return StreamingChoice(prefetch, engine, size, free, "asked for the prefetcher", False)
    options = prefetch.options
    memory = options.memory if isinstance(options.memory, int) else None
    asked_less = memory is not None and memory < size
    if fits(size, free, reserve) and not asked_less:
        return StreamingChoice(
            None,
            "llama.cpp",
            size,
            free,
            f"the model ({size / 1e9:.2f} GB) fits in the {_size(free)} available",
        )
    why = (
        f"the model ({size / 1e9:.2f} GB) is larger than `memory` {_size(memory)}"
        if memory is not None and asked_less
        else f"the model ({size / 1e9:.2f} GB) does not fit in the {_size(free)} available"
    )
    return StreamingChoice(options, _engine(options, size, free), size, free, why)


def pager_works() -> bool:
    """Whether a userfaultfd can be had here (the pager's C part built and its probe)."""
    from ..prefetcher.pager import PagerRefused, open_userfaultfd, pager_library

    lib = pager_library()
    if lib is None:
        return False
    try:
        fd, _how = open_userfaultfd(lib)
    except PagerRefused:
        return False
    os.close(fd)
    return True


def _engine(options: StreamOptions, size: int, available: int) -> str:
    """Which engine the streamer will take the experts with (``streamer.wants_pager``)."""
    if wants_pager(options, size, available) and pager_works():
        return "pager"
    return "page cache"


def _size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"
