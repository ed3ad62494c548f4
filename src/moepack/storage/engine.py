"""The read-engine interface and its registry (the counterpart of fio's ioengines).

An engine issues reads against an ``OpenFile`` at a queue depth. It pulls requests from a
``Workload`` and hands each completed one back, with the bytes and its latency, so the same
engines serve both measurement (count bytes, keep latencies) and real reads (copy the bytes
out). Engines own their buffers and finish every request in full: a short read is continued
until the requested length or end of file, exactly as a plain read would return.

Adding an engine is adding one module under ``engines/`` whose ``PLUGIN`` (or ``PLUGINS``) is
a ``ReadEngine`` instance; ``READ_ENGINES`` (``moepack.registry``) finds every module there, lists
them by the module's ``ORDER`` and refuses two engines with one name.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import ClassVar, Protocol

from ..errors import BadInput
from ..registry import Registry
from .modes import Mode, OpenFile


class Workload(Protocol):
    """Where an engine gets its requests and delivers their results.

    An engine serialises calls to ``next`` and ``complete`` (never two at once).
    """

    max_length: int  # no request is longer; engines size their buffers to it

    def next(self) -> tuple[int, int, int] | None:
        """The next request as ``(token, offset, length)``, or ``None`` when there is none."""

    def complete(self, token: int, data: memoryview, nbytes: int, latency_ns: int) -> None:
        """Request ``token`` finished: ``data[:nbytes]`` holds its bytes (short only at EOF)."""


MAX_QUEUE_DEPTH = 1024
"""Deeper queues are refused: an io_uring ring holds at most 32768 entries, each unit of depth
of ``threads`` is an OS thread, and no device gains from more than a few hundred reads in
flight (NVMe queues are 1023 deep; a probe's default stops at 64)."""


def check_depths(depths: list[int]) -> None:
    """``BadInput`` for a queue depth below 1 or above ``MAX_QUEUE_DEPTH``."""
    for qd in depths:
        if qd < 1:
            raise BadInput(f"queue depth must be at least 1, got {qd}")
        if qd > MAX_QUEUE_DEPTH:
            raise BadInput(
                f"queue depth {qd} is above moepack's limit of {MAX_QUEUE_DEPTH}: "
                "no device gains from more reads in flight, each unit of depth of 'threads' "
                "is a thread, and an io_uring ring holds at most 32768"
            )


class ReadEngine(ABC):
    """A way of issuing reads. Subclasses set the class attributes and implement ``run``."""

    name: ClassVar[str]
    summary: ClassVar[str]
    modes: ClassVar[frozenset[Mode]] = frozenset(Mode)
    max_depth: ClassVar[int | None] = None  # None: any queue depth

    def unavailable_reason(self) -> str | None:
        """Why this engine cannot run on this machine, or ``None`` when it can."""
        return None

    def check(self, mode: Mode, queue_depth: int) -> None:
        """Raise ``BadInput`` when this engine cannot run ``mode`` at ``queue_depth``."""
        if mode not in self.modes:
            served = ", ".join(m.label for m in Mode if m in self.modes)
            raise BadInput(
                f"engine {self.name!r} cannot read in {mode.label} mode (it serves {served})"
            )
        check_depths([queue_depth])
        if self.max_depth is not None and queue_depth > self.max_depth:
            raise BadInput(
                f"engine {self.name!r} runs at queue depth {self.max_depth} only "
                f"(asked for {queue_depth}); use 'threads' or 'uring' for deeper queues"
            )

    @abstractmethod
    def run(self, f: OpenFile, work: Workload, queue_depth: int) -> None:
        """Serve every request of ``work`` with up to ``queue_depth`` reads in flight."""


def read_full(f: OpenFile, view: memoryview, offset: int, length: int) -> int:
    """``preadv`` until ``length`` bytes or end of file; returns the bytes read."""
    got = 0
    while got < length:
        n = os.preadv(f.fd, [view[got:length]], offset + got, f.rw_flags)
        if n <= 0:
            break
        got += n
        if offset + got >= f.size:
            break
    return got


READ_ENGINES: Registry[ReadEngine] = Registry(
    "engine", f"{__package__}.engines", base=ReadEngine, every_module=True
)
"""Every read engine, listed by module ``ORDER``: pread, threads, uring, uring-batch, mmap."""


def all_engines() -> dict[str, ReadEngine]:
    """Every engine, by name, in listing order."""
    return {e.name: e for e in READ_ENGINES}


def get_engine(name: str) -> ReadEngine:
    """The engine called ``name``; ``BadInput`` listing the known ones otherwise."""
    return READ_ENGINES.get(name)
