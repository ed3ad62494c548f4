"""What ``run``, ``serve`` and ``streaming_llama`` run a model with when no flag says, and what
``fit`` estimates: one rule, chosen by measurement at the size people run
(``benchmarks/bench_real.py``; the figures are in ``docs/run.md``).

- The model fits in the memory available (its file and what the context needs, counted by
  ``memory_plan``, with room): llama.cpp's own defaults, its repacked kernels included.
- It does not: the expert prefetcher with the pager (userfaultfd over llama.cpp's mapping,
  ``O_DIRECT`` reads, a hard budget: what the memory available less a margin, or ``--memory``,
  leaves once the dense weights, the context and the prefix cache are counted). At 17 GB
  with 12 GiB left it decoded 2.6-3.3x the page-cache prefetcher and over 10x llama.cpp's own
  mmap.
- Where userfaultfd is refused: the page-cache prefetcher (the streamer says why in one
  warning).

``--prefetch`` / ``--no-prefetch`` (``StreamOptions`` / ``None``) choose otherwise; ``AutoStream``
carries the flags' options to use where streaming is chosen.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

from ...checkpoint.model import MoeModel
from ...storage.linux import mem_available
from ..prefetcher.pager import minimum_budget
from ..prefetcher.prefetch import ExpertRanges
from ..prefetcher.streamer import StreamOptions, wants_pager
from .memory_plan import MemoryPlan, check_streaming_plan, plan_memory

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
    plan: MemoryPlan | None = None  # where the memory goes (None: no prefetcher asked)

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
            "memory": self.plan.to_json() if self.plan is not None else None,
        }


def choose_streaming(
    model: str | os.PathLike[str],
    prefetch: Prefetch,
    *,
    memory: int | str = "auto",
    n_ctx: int = 4096,
    n_batch: int = 512,
    prefix_cache: int = 0,
    available: int | None = None,
    threads: int = 1,
) -> StreamingChoice:
    """What runs ``model`` here when ``prefetch`` is asked for, in ``memory`` (the bytes the
    whole run may take, or ``auto``: the memory ``available`` — measured now when None — less
    a margin), with a context of ``n_ctx`` tokens and a prefix cache of ``prefix_cache``
    bytes counted in it (``memory_plan``), llama.cpp computing on at most ``threads`` threads
    at once (each may hold an expert slice: the pager's minimum). Where the experts stream
    under a budget, the
    options carry it (``StreamOptions.memory``: what the plan leaves them, or less where the
    options asked less); a plan that leaves them too little is refused here, in one line,
    before anything loads."""
    with MoeModel(model) as m:
        size = m.file_bytes
        least = minimum_budget(ExpertRanges(m), threads)
    free = mem_available() if available is None else available
    if prefetch is None:
        return StreamingChoice(None, "llama.cpp", size, free, "asked for no prefetcher", False)
    plan = plan_memory(
        model,
        memory,
        n_ctx=n_ctx,
        n_batch=n_batch,
        prefix_cache=prefix_cache,
        available=free,
    )
    return stream_in_plan(
        model, prefetch, plan, least=least, available=free, n_batch=n_batch, threads=threads
    )


def stream_in_plan(
    model: str | os.PathLike[str],
    prefetch: StreamOptions | AutoStream,
    plan: MemoryPlan,
    *,
    least: int,
    available: int,
    n_batch: int = 512,
    threads: int = 1,
) -> StreamingChoice:
    """``choose_streaming`` once its memory ``plan`` is made: the engine, and the experts'
    budget where they stream (``least``: the pager's minimum at ``threads``); ``BadInput``
    where the plan leaves them less. ``fit`` asks it of plans at other memory sizes."""
    size = plan.file_bytes
    options = prefetch.options if isinstance(prefetch, AutoStream) else prefetch
    if isinstance(prefetch, StreamOptions):
        reason, automatic = "asked for the prefetcher", False
    elif plan.fits:
        where = "--memory" if plan.asked else "the memory available"
        why = (
            f"the model ({size / 1e9:.2f} GB) and its context fit in {where} ({_size(plan.total)})"
        )
        return StreamingChoice(None, "llama.cpp", size, available, why, True, plan)
    else:
        where = "`memory`" if plan.asked else "the memory available"
        reason = (
            f"the model ({size / 1e9:.2f} GB) and its context do not fit in {where} "
            f"({_size(plan.total)})"
        )
        automatic = True
    if not plan.fits:  # the experts stream under what the plan leaves them
        paged = options.pager != "off"
        why = f"the pager's minimum at {threads} compute thread(s)" if paged else ""
        check_streaming_plan(plan, least, model, n_batch, why)
        asked = options.memory if isinstance(options.memory, int) else plan.experts
        options = replace(options, memory=min(asked, plan.experts))
    engine = _engine(options, size, available)
    return StreamingChoice(options, engine, size, available, reason, automatic, plan)


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
