"""What ``moepack run`` and ``serve`` will run a model with here, asked of their own code.

``fit`` estimates the run a user gets with no flags, so the engine, the budget and the
threads come from the functions ``run`` and ``serve`` call before they load anything
(``llama.runtime.run.resolve_run``: ``resolve_threads``, the threads and the thread tuner's
choices, and ``choice.choose_streaming`` with ``memory_plan.plan_memory``; ``placement.choose``;
the streamer's live-cache arithmetic), at the memory available given (or measured now) and the
``--memory`` asked for. ``serve`` is asked as serve asks: no tuner, its context a whole number
of llama.cpp's steps, its default prefix cache counted in the memory. A run that would be
refused before loading (a context that leaves the experts less than the pager needs) is a
refusal here too, in run's own words.

The other memory sizes ``fit`` shows and its knee (``RunChooser.at``) take the main plan's
context as llama.cpp counted it, move only the total and ask run's own ``stream_in_plan``, so
a sweep of 32 sizes needs no more of llama.cpp than one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..checkpoint.model import MoeModel
from ..errors import BadInput
from ..llama.prefetcher.pager import minimum_budget
from ..llama.prefetcher.prefetch import ExpertRanges
from ..llama.prefetcher.streamer import (
    StreamOptions,
    live_cache_reserve,
    live_cache_slots,
)
from ..llama.runtime.choice import AutoStream, StreamingChoice, stream_in_plan
from ..llama.runtime.memory_plan import MemoryPlan, plan_memory
from ..llama.runtime.placement import choose as choose_placement
from ..llama.runtime.run import RunThreads, resolve_run, resolve_threads
from ..serve.prefixcache import budget_bytes as prefix_budget
from ..serve.server import ServeOptions, served_context

ENGINES = ("llama.cpp", "pager", "page cache", "refused")


@dataclass(frozen=True)
class RunChoice:
    """One run as ``run`` (or ``serve``) would set it up: the engine, where the memory goes,
    the threads."""

    engine: str  # ENGINES
    plan: MemoryPlan
    threads: int  # decode threads at the start (the tuner's fewest); serve's always
    tune: tuple[int, int] | None  # the counts run's tuner chooses between
    threads_batch: int  # passes of more than one token (prompts)
    placement: str  # where llama.cpp keeps the experts ("defaults" or "experts-mapped")
    available: int  # the memory available the choice was made in
    reason: str  # the choice's own words
    budget: int = 0  # the experts' bytes where they stream (StreamOptions.memory)
    cache_bytes: int = 0  # the live cache inside it
    slots: int = 0  # experts per layer the live cache holds (0: none)
    least: int = 0  # the pager's least budget at the threads that fault at once
    refusal: str | None = None  # run's one line where it refuses before loading
    pinned: bool = False  # the dense weights are locked (the prefetcher's pin_dense auto)

    @property
    def streams(self) -> bool:
        return self.engine in ("pager", "page cache")

    def describe(self, chosen: int | None = None) -> str:
        """One line: what a run with no flags does (``chosen``: the count the tuner is
        expected to settle on)."""
        if self.refusal is not None:
            return "refused before loading"
        if self.tune and chosen is not None:
            decode = (
                f"decode at {chosen} thread{'s' if chosen != 1 else ''} (the tuner's choice "
                f"of {self.tune[0]} or {self.tune[1]})"
            )
        elif self.tune:
            decode = f"decode at {self.tune[0]} or {self.tune[1]} threads (tuned)"
        else:
            decode = f"decode at {self.threads} thread{'s' if self.threads != 1 else ''}"
        prompts = f"prompts at {self.threads_batch}"
        if self.plan.prefix_cache:
            prompts += f", prefix cache {_gib(self.plan.prefix_cache)}"
        if self.engine == "llama.cpp":
            kernels = "repacked kernels" if self.placement == "defaults" else "experts mapped"
            return f"llama.cpp's defaults ({kernels}), {decode}, {prompts}"
        cache = (
            f", live cache {_gib(self.cache_bytes)} ({self.slots} experts a layer)"
            if self.slots
            else ""
        )
        return f"{self.engine}, budget {_gib(self.budget)}{cache}, {decode}, {prompts}"

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "summary": self.describe(),
            "reason": self.reason,
            "refusal": self.refusal,
            "available_bytes": self.available,
            "memory": self.plan.to_json(),
            "placement": self.placement,
            "threads": self.threads,
            "thread_choices": list(self.tune) if self.tune else None,
            "threads_batch": self.threads_batch,
            "serve_threads": self.threads,
            "budget_bytes": self.budget,
            "cache_bytes": self.cache_bytes,
            "slots_per_layer": self.slots,
            "least_budget_bytes": self.least,
            "dense_pinned": self.pinned,
        }


class RunChooser:
    """``run``'s choices (``serve``'s with ``serve``) for one model at one memory available
    and thread setting."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        available: int,
        threads: int | None = None,
        threads_batch: int | None = None,
        n_ctx: int = 4096,
        n_batch: int = 512,
        serve: bool = False,
    ) -> None:
        self.model = Path(model)
        self.available = available
        self.asked_threads = threads
        self.asked_batch = threads_batch
        self.serve = serve
        # serve asks llama.cpp for a whole number of its context steps, keeps a prefix cache
        # (its default size, counted in the memory) and decodes without the tuner
        self.n_ctx = served_context(n_ctx) if serve else n_ctx
        # serve's prefix cache at the memory available (choose() sizes it at another memory)
        self.prefix_cache = self._prefix("auto")
        self.n_batch = n_batch
        with MoeModel(self.model) as m:
            self.layout = ExpertRanges(m)
            self.top_k = m.top_k
            self.file_bytes = m.file_bytes
        self._context: MemoryPlan | None = None  # a plan whose context llama.cpp counted
        self.threads = resolve_threads(
            self.model,
            threads=threads,
            threads_batch=threads_batch,
            tune=not serve,
            available=available,
        )

    def _prefix(self, memory: int | str) -> int:
        """The prefix cache serve keeps at ``memory`` (run keeps none)."""
        if not self.serve:
            return 0
        return prefix_budget(ServeOptions(memory=memory), available=self.available)

    # -- the real code path --------------------------------------------------------------------
    def choose(self, memory: int | None = None) -> RunChoice:
        """What ``run MODEL`` (``serve``; with ``--memory memory`` when given) chooses: its
        own code."""
        asked: int | str = memory if memory is not None else "auto"
        self.prefix_cache = self._prefix(asked)
        try:
            settings = resolve_run(
                self.model,
                AutoStream(),
                threads=self.asked_threads,
                threads_batch=self.asked_batch,
                memory=asked,
                n_ctx=self.n_ctx,
                n_batch=self.n_batch,
                tune=not self.serve,
                prefix_cache=self.prefix_cache,
                available=self.available,
            )
        except BadInput as e:
            plan = plan_memory(
                self.model,
                asked,
                n_ctx=self.n_ctx,
                n_batch=self.n_batch,
                prefix_cache=self.prefix_cache,
                available=self.available,
            )
            return self._refused(plan, e.message)
        streaming = settings.streaming
        assert streaming.plan is not None  # AutoStream always plans
        plan = streaming.plan
        if plan.context.compute_bytes:
            self._context = plan
        return self._finish(streaming, settings)

    # -- the same code at other sizes -----------------------------------------------------------
    def at(self, memory: int) -> RunChoice:
        """``run --memory memory``'s choice: run's own ``stream_in_plan`` on its plan at that
        size, the context as llama.cpp counted it once (for sweeps over memory sizes, which
        would otherwise ask llama.cpp again at every size)."""
        plan = replace(self.counted(), total=memory, asked=True, prefix_cache=self._prefix(memory))
        t = self.threads
        least = self._least(t.fault_threads)
        try:
            streaming = stream_in_plan(
                self.model,
                AutoStream(),
                plan,
                least=least,
                available=self.available,
                n_batch=self.n_batch,
                threads=t.fault_threads,
            )
        except BadInput as e:
            return self._refused(plan, e.message)
        return self._finish(streaming, t)

    def counted(self) -> MemoryPlan:
        """A plan whose context llama.cpp counted (the main one, or asked for once)."""
        if self._context is None:  # nothing fits in none: llama.cpp is asked
            self._context = plan_memory(
                self.model,
                "auto",
                n_ctx=self.n_ctx,
                n_batch=self.n_batch,
                prefix_cache=self.prefix_cache,
                available=0,
            )
        return self._context

    def _least(self, threads: int) -> int:
        return minimum_budget(self.layout, threads)

    def _refused(self, plan: MemoryPlan, refusal: str) -> RunChoice:
        t = self.threads
        return RunChoice(
            "refused",
            plan,
            t.threads,
            t.tune,
            t.threads_batch,
            "experts-mapped",
            self.available,
            "the memory does not hold the context and the experts' least",
            refusal=refusal,
            least=self._least(t.fault_threads),
        )

    def _finish(self, streaming: StreamingChoice, t: RunThreads) -> RunChoice:
        assert streaming.plan is not None
        plan = streaming.plan
        options = streaming.prefetch
        engine = streaming.engine
        placement, _why = choose_placement(self.file_bytes, options is not None, self.available)
        least = self._least(t.fault_threads)
        common = (plan, t.threads, t.tune, t.threads_batch, placement, self.available)
        if options is None:
            return RunChoice(engine, *common, streaming.reason, least=least)
        assert isinstance(options.memory, int)
        cache, slots = self._live_cache(options, engine)
        pinned = options.pin_dense == "on" or (
            options.pin_dense == "auto" and self.file_bytes > self.available
        )
        return RunChoice(
            engine,
            *common,
            streaming.reason,
            budget=options.memory,
            cache_bytes=cache,
            slots=slots,
            least=least,
            pinned=pinned,
        )

    def _live_cache(self, options: StreamOptions, engine: str) -> tuple[int, int]:
        """The live cache the streamer sizes (``streamer._start_cache``): inside the pager's
        budget less one layer's demand and the lookahead's, or the budget itself where the
        page cache holds the experts; (bytes, fewest slots of a layer), (0, 0) for none."""
        assert isinstance(options.memory, int)
        if options.cache == "kernel":
            return 0, 0
        if engine == "pager":
            budget = options.memory - live_cache_reserve(options, self.layout, self.top_k)
            if isinstance(options.cache, int):
                budget = min(budget, options.cache)
        elif isinstance(options.cache, int):
            budget = options.cache
        else:
            budget = options.memory
        try:
            slots = live_cache_slots(budget, self.layout, self.top_k)
        except BadInput:
            return 0, 0  # the pager's own LRU (or the kernel) decides what stays
        return budget, min(slots)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"
