"""Every llama.cpp pass of the served model measured, and where each generation starts and
ends.

llama-cpp-python's server makes its ``Llama`` with its own loader, so no subclass of ours can
stand in for it; the two methods every completion goes through are wrapped on that one
instance instead (``Meter.install``): ``generate`` (one call per request, once the server's
lock has let it in: where a request's work starts and ends) and ``eval`` (its first call in
a generation feeds the prompt — prefill, the part of it llama.cpp did not keep from the
previous request — and every later call one sampled token — decode). Each ``eval`` is timed
and this process's counters read around it (``run_worker.counters``: the device's bytes,
major faults, CPU), so the metrics say per phase what ``moepack run`` says.

The prefetcher's own counters are read once a generation is over (``PrefetchHook.snapshot``
waits for the read-ahead thread, which a pass must not), never while llama.cpp computes.

Streaming clients that leave mid-stream abandon their generator: Python closes it later, in
whichever thread drops it. A generation is therefore closed by the next one's start or by its
own end, whichever comes first, under one lock; a late close of a finished generation does
nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any

from ..llama.runtime.run_worker import counters
from .tracing import TraceSpool

PHASES = ("prefill", "decode")


@dataclass
class PhaseTotals:
    """Tokens, time in llama.cpp and this process's counters over a phase's ``eval`` calls."""

    tokens: int = 0
    ns: int = 0
    read_bytes: int = 0
    major_faults: int = 0
    cpu_ns: int = 0

    def add(self, tokens: int, ns: int, before: dict[str, int], after: dict[str, int]) -> None:
        self.tokens += tokens
        self.ns += ns
        self.read_bytes += after.get("read_bytes", 0) - before.get("read_bytes", 0)
        self.major_faults += after["major_faults"] - before["major_faults"]
        self.cpu_ns += after["cpu_ns"] - before["cpu_ns"]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / (self.ns / 1e9) if self.ns else 0.0

    def per_token(self, value: float) -> float:
        return value / self.tokens if self.tokens else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "seconds": self.ns / 1e9,
            "tokens_per_second": self.tokens_per_second,
            "bytes_read_per_token": self.per_token(self.read_bytes),
            "major_faults_per_token": self.per_token(self.major_faults),
            "cpu_seconds": self.cpu_ns / 1e9,
        }


@dataclass
class ServedGeneration:
    """One ``generate`` call: a request's work on the model."""

    index: int
    prompt: list[int]
    phases: dict[str, PhaseTotals] = field(
        default_factory=lambda: {p: PhaseTotals() for p in PHASES}
    )
    generated: list[int] = field(default_factory=list)
    prefilled: bool = False
    opened_ns: int = field(default_factory=perf_counter_ns)
    first_token_ns: int | None = None  # when ``generate`` yielded its first token
    prefetch: dict[str, float] = field(default_factory=dict)  # its share of the counters
    owner: Any = None  # the request it ran for (``requestlog``), if one was current


class Meter:
    """The measurements of one served ``Llama`` (see the module docstring)."""

    def __init__(
        self,
        llm: Any,
        *,
        snapshot: Callable[[], dict[str, float]] | None = None,
        tracer: TraceSpool | None = None,
    ) -> None:
        self.llm = llm
        self._snapshot = snapshot
        self.tracer = tracer
        self.totals = {p: PhaseTotals() for p in PHASES}
        self.last: dict[str, PhaseTotals] = {p: PhaseTotals() for p in PHASES}
        self.generations = 0
        self.prefetch: dict[str, float] = {}  # the prefetcher's counters at the last close
        self.last_prefetch: dict[str, float] = {}  # the last generation's share of them
        self.active: ServedGeneration | None = None
        self._lock = threading.Lock()  # held by every eval and every open and close
        self._stats = threading.Lock()  # the numbers /metrics reads
        self._eval = llm.eval
        self._generate = llm.generate
        # told of every generation as it opens (in the thread of its request) and once it is
        # closed, its counters final (``requestlog``)
        self.on_open: Callable[[ServedGeneration], None] | None = None
        self.on_finish: Callable[[ServedGeneration], None] | None = None

    def install(self) -> None:
        """Measure from now on (the instance's ``eval`` and ``generate`` wrapped)."""
        self.llm.eval = self.eval
        self.llm.generate = self.generate

    # -- wrapped methods -------------------------------------------------------------------

    def generate(
        self, tokens: Sequence[int], *args: Any, **kwargs: Any
    ) -> Generator[int, Sequence[int] | None, None]:
        """``Llama.generate``, opened and closed as one generation."""
        gen = self._open(list(tokens))
        inner = self._generate(tokens, *args, **kwargs)
        try:
            sent: Sequence[int] | None = None
            while True:
                try:
                    token = inner.send(sent) if sent is not None else next(inner)
                except StopIteration:
                    return
                if gen.first_token_ns is None:
                    gen.first_token_ns = perf_counter_ns()
                gen.generated.append(int(token))
                sent = yield token
        finally:
            inner.close()
            self._close(gen)

    def eval(self, tokens: Sequence[int]) -> None:
        """``Llama.eval``, timed and counted as prefill or decode."""
        with self._lock:
            gen = self.active
            phase = "decode"
            if gen is None or not gen.prefilled:
                phase = "prefill"
                if gen is not None:
                    gen.prefilled = True
            before, t0 = counters(), perf_counter_ns()
            try:
                self._eval(tokens)
            except BaseException:
                if self.tracer is not None:
                    self.tracer.discard()
                raise
            ns, after = perf_counter_ns() - t0, counters()
            n = len(tokens)
            with self._stats:
                self.totals[phase].add(n, ns, before, after)
                if gen is not None:
                    gen.phases[phase].add(n, ns, before, after)
            if self.tracer is not None:
                self.tracer.after_eval(n, phase)

    def uncount(self, tokens: int) -> None:
        """Drafted tokens a decode pass computed and the generation did not keep: not
        tokens of its output (told after the pass, by ``draft_hook``)."""
        with self._stats:
            self.totals["decode"].tokens -= tokens
            if self.active is not None:
                self.active.phases["decode"].tokens -= tokens

    # -- generations -------------------------------------------------------------------------

    def _open(self, prompt: list[int]) -> ServedGeneration:
        with self._lock:
            if self.active is not None:
                self._finish(self.active)
            gen = ServedGeneration(self.generations, prompt)
            self.generations += 1
            self.active = gen
            if self.tracer is not None:
                self.tracer.begin(prompt)
            if self.on_open is not None:
                self.on_open(gen)
            return gen

    def _close(self, gen: ServedGeneration) -> None:
        if self.active is not gen:  # already closed by the next generation's start
            return
        with self._lock:
            if self.active is gen:
                self._finish(gen)

    def _finish(self, gen: ServedGeneration) -> None:
        """Close ``gen`` (the lock held, no pass running)."""
        self.active = None
        snap = self._snapshot() if self._snapshot is not None else {}
        with self._stats:
            self.last = gen.phases
            self.last_prefetch = {k: v - self.prefetch.get(k, 0.0) for k, v in snap.items()}
            self.prefetch = snap
            gen.prefetch = dict(self.last_prefetch)
        if self.tracer is not None:
            self.tracer.end(gen.generated, self._detokenize)
        if self.on_finish is not None:
            self.on_finish(gen)

    def _detokenize(self, tokens: list[int]) -> str:
        return bytes(self.llm.detokenize(tokens)).decode("utf-8", errors="replace")

    def close(self) -> None:
        """The server stopped: close the generation still open (its segment is sent)."""
        with self._lock:
            if self.active is not None:
                self._finish(self.active)

    # -- what /metrics reads -----------------------------------------------------------------

    def read(
        self,
    ) -> tuple[
        dict[str, PhaseTotals], dict[str, PhaseTotals], dict[str, float], dict[str, float], int
    ]:
        """(totals, the last generation's phases, prefetch counters so far, the last
        generation's share of them, generations run), consistent with each other."""
        with self._stats:
            copy = {p: PhaseTotals(**vars(t)) for p, t in self.totals.items()}
            last = {p: PhaseTotals(**vars(t)) for p, t in self.last.items()}
            return copy, last, dict(self.prefetch), dict(self.last_prefetch), self.generations
