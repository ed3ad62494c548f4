"""The decode thread count chosen from what the run measures, when nobody gave one.

Under memory pressure the better count depends on what limits a token: where the disk does,
a core left to the reads and the kernel's reclaim is worth more than a compute thread that
waits for pages (random routing on the 2-core machine: 2 threads at 0.95x of 1); where the
live cache keeps most experts and compute does, every core is (planted routing: 2 threads at
1.34x; ``benchmarks/bench_draft.py --threads-only``). ``ThreadTuner`` decodes a few passes at
each count, the counts taking turns pass by pass (so the cache warming up after a cold start,
or a stretch of text that routes worse, weighs on each alike), keeps the faster by the median
wall time of a pass (more threads must win by ``MARGIN``), and tries again after a gap that
doubles while the choice stands. It starts at the fewest (today's default under pressure), so
a run whose probes lose pays only their few passes. A first version timed the counts in
blocks: the block right after the cold start was slower for its own reasons, and on random
routing it chose 2 threads at 0.93x of 1. The thread count
does not change what a token computes: ggml gives each output row to one thread whole, so
the logits are the same bits at any count (``tests/llama/test_threadtune.py``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

PROBE = 6
"""Passes timed at each count in a probe (after one untimed pass: the cold one)."""
MARGIN = 0.05
"""More threads are chosen only when their median pass is this much shorter."""
FIRST_GAP = 32
MAX_GAP = 512
"""Passes between probes of the other count: doubling from the first to the last while the
choice stands."""


class ThreadTuner:
    """Chooses among ``choices`` (sorted, fewest first) for every decode pass; ``apply``
    sets llama.cpp's decode thread count."""

    def __init__(self, choices: Sequence[int], apply: Callable[[int], None]) -> None:
        self.choices = sorted(set(int(c) for c in choices))
        if not self.choices or self.choices[0] < 1:
            raise ValueError("thread choices must be positive")
        self._apply = apply
        self.current = self.choices[0]
        self.chosen = self.current
        self.times: dict[int, list[float]] = {c: [] for c in self.choices}
        self.passes: dict[int, int] = {c: 0 for c in self.choices}
        self.switches = 0
        self.probes = 0
        self._queue: list[int] = []  # counts of the passes still to time in this probe
        self._settle = 1  # passes not timed: the first, the cold one
        self._gap = FIRST_GAP
        self._until_probe = 0
        self._start_probe()

    def _start_probe(self) -> None:
        """Time ``PROBE`` passes at every count, taking turns, the chosen one last."""
        order = [c for c in self.choices if c != self.chosen] + [self.chosen]
        if self.probes == 0:
            order = list(self.choices)
        self._queue = [c for _ in range(PROBE) for c in order]
        self._fresh: dict[int, list[float]] = {c: [] for c in self.choices}
        self.probes += 1

    def next_threads(self) -> int:
        """The count for the next pass (set in llama.cpp when it changes)."""
        want = self._queue[0] if self._queue else self.chosen
        if want != self.current:
            self._apply(want)
            self.current = want
            self.switches += 1
        return want

    def record(self, seconds: float) -> None:
        """The wall time of the pass just decoded at ``current``."""
        self.passes[self.current] += 1
        timed = self._settle == 0
        self._settle = max(0, self._settle - 1)
        if not timed:  # the cold pass: not a probe's
            return
        if self._queue:
            self._queue.pop(0)
            self._fresh[self.current].append(seconds)
            self.times[self.current].append(seconds)
            if not self._queue:
                self._judge()
            return
        self._until_probe -= 1
        if self._until_probe <= 0:
            self._start_probe()

    def _judge(self) -> None:
        medians = {c: statistics.median(v) for c, v in self._fresh.items() if v}
        if medians:
            best = min(medians)  # the fewest, unless more win by the margin
            for c in sorted(medians):
                if medians[c] < medians[best] * (1 - MARGIN):
                    best = c
            stood = self.probes > 1 and best == self.chosen
            self._gap = min(MAX_GAP, 2 * self._gap) if stood else FIRST_GAP
            self.chosen = best
        self._until_probe = self._gap

    def report(self) -> dict[str, Any]:
        return {
            "choices": self.choices,
            "chosen": self.chosen,
            "passes": {str(c): n for c, n in self.passes.items()},
            "seconds_per_pass": {str(c): statistics.median(v) for c, v in self.times.items() if v},
            "probes": self.probes,
            "switches": self.switches,
        }
