"""Explicit expert prefetch: read the router's chosen experts into the page cache.

llama.cpp reads expert weights through its memory map, so under memory pressure every miss is
a page fault that reads one read-around window at a time, blind to the router. Once a layer's
top-k is known (the eval callback on ``ffn_moe_topk-<il>`` fires before that layer's expert
matmuls), the chosen experts' slices are known ranges of the file under its actual layout:
this module turns expert ids into merged file ranges, skips the pages already cached
(``cachestat``), and reads the rest with one of moepack's read engines at a queue depth, so the
matmuls find their pages resident. It computes nothing llama.cpp computes, so no number changes.

Ids are the file's own expert positions (a repacked file's router rows moved with its
experts), so the same arithmetic serves original, repacked and fused (``gate_up``) files.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from time import perf_counter_ns
from typing import Protocol

import numpy as np

from ...checkpoint.model import MoeModel
from ...errors import BadInput
from ...storage.engine import get_engine
from ...storage.linux import PAGE_SIZE, cachestat
from ...storage.modes import Mode, OpenFile, open_file

CHUNK = 1 << 20
"""Largest single read: long merged ranges are split so a queue depth has requests to spread
over, and the engines' buffer pools keep one shape (they are reused between calls)."""


@dataclass(frozen=True)
class FileRange:
    """Bytes ``[offset, offset + length)`` of shard ``shard``."""

    shard: int
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


def merge_ranges(ranges: Iterable[FileRange]) -> list[FileRange]:
    """Sorted ranges with touching or overlapping neighbours joined (one read instead of two)."""
    out: list[FileRange] = []
    for r in sorted(ranges, key=lambda r: (r.shard, r.offset)):
        if r.length <= 0:
            continue
        if out and out[-1].shard == r.shard and r.offset <= out[-1].end:
            last = out[-1]
            out[-1] = FileRange(last.shard, last.offset, max(last.end, r.end) - last.offset)
        else:
            out.append(r)
    return out


def _runs(ids: Iterable[int]) -> list[tuple[int, int]]:
    """Consecutive id runs as ``(first, count)``: adjacent experts are adjacent bytes."""
    runs: list[tuple[int, int]] = []
    for e in sorted(set(ids)):
        if runs and runs[-1][0] + runs[-1][1] == e:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((e, 1))
    return runs


CONSUMED = {"up": 0, "gate_up": 0, "gate": 1, "down": 2}
"""The order llama.cpp's ``build_moe_ffn`` runs a layer's expert matmuls in: up (or the fused
gate+up), gate, down; each ``MUL_MAT_ID`` takes its experts in id order."""


class ExpertRanges:
    """Where each MoE block's expert slices sit in the file(s): ids → merged file ranges."""

    def __init__(self, model: MoeModel) -> None:
        self.n_expert: dict[int, int] = {}
        self._tensors: dict[int, list[tuple[int, int, int]]] = {}  # block: (shard, base, slice)
        for block in model.blocks:
            if not block.runs:  # an MTP block: llama.cpp's decode graph never reads it
                continue
            self.n_expert[block.index] = block.n_expert
            ordered = sorted(block.weight_tensors, key=lambda t: CONSUMED.get(t.kind, 3))
            self._tensors[block.index] = [(t.shard, t.entry.offset, t.slice_bytes) for t in ordered]
        # the same as int64 [tensors, 3] (shard, base, slice), for slice_rows
        self._table = {
            b: np.array(t, dtype=np.int64).reshape(-1, 3) for b, t in self._tensors.items()
        }

    @property
    def blocks(self) -> list[int]:
        return sorted(self._tensors)

    def whole_tensors(self, block: int) -> list[FileRange]:
        """Every expert matrix of ``block`` in full (for the all-cached fast path)."""
        n = self.n_expert[block]
        return [FileRange(s, base, size * n) for s, base, size in self._tensors.get(block, [])]

    def table(self, block: int) -> np.ndarray:
        """int64 ``[matrices, 3]`` (shard, base offset, slice bytes) of ``block``'s expert
        matrices, in the order its matmuls read them."""
        return self._table.get(block, np.zeros((0, 3), dtype=np.int64))

    def slice_rows(self, block: int, experts: Iterable[int]) -> np.ndarray:
        """int64 ``[n, 4]`` rows ``(shard, expert, offset, length)``: every slice of
        ``experts`` in ``block``, in the order the layer's matmuls read them (matrix by
        matrix, experts ascending within each)."""
        ids = np.unique(np.fromiter((int(e) for e in experts), dtype=np.int64))
        ids = ids[(ids >= 0) & (ids < self.n_expert.get(block, 0))]
        table = self._table.get(block)
        if table is None or not ids.size:
            return np.zeros((0, 4), dtype=np.int64)
        t, e = table.shape[0], ids.size
        out = np.empty((t * e, 4), dtype=np.int64)
        out[:, 0] = np.repeat(table[:, 0], e)
        out[:, 1] = np.tile(ids, t)
        out[:, 2] = (table[:, 1:2] + ids[None, :] * table[:, 2:3]).ravel()
        out[:, 3] = np.repeat(table[:, 2], e)
        return out

    def expert_bytes(self, block: int) -> int:
        """Bytes of one expert of ``block`` across its matrices."""
        return sum(size for _s, _b, size in self._tensors.get(block, []))

    def ranges(self, block: int, experts: Iterable[int]) -> list[FileRange]:
        """Merged file ranges of ``experts``' slices in every expert matrix of ``block``."""
        tensors = self._tensors.get(block)
        if not tensors:
            return []
        n = self.n_expert[block]
        runs = _runs(e for e in experts if 0 <= e < n)
        out = [
            FileRange(shard, base + first * size, count * size)
            for shard, base, size in tensors
            for first, count in runs
        ]
        return merge_ranges(out)


def _pages(offset: int, length: int) -> int:
    first = offset // PAGE_SIZE
    last = (offset + length - 1) // PAGE_SIZE
    return last - first + 1


@dataclass
class PrefetchStats:
    """What the prefetcher did, summed over a run (bytes, requests, nanoseconds)."""

    calls: int = 0
    ranges: int = 0  # merged expert ranges looked at
    bytes_wanted: int = 0  # bytes of the chosen experts' slices
    bytes_resident: int = 0  # of those, already in the page cache (skipped)
    bytes_read: int = 0  # read by the engine
    reads: int = 0  # read requests issued
    ns_total: int = 0  # wall time inside the prefetcher (residency checks included)
    ns_reading: int = 0  # wall time inside the engine

    def to_json(self) -> dict[str, int | float]:
        d: dict[str, int | float] = dict(asdict(self))
        d["seconds_total"] = self.ns_total / 1e9
        d["seconds_reading"] = self.ns_reading / 1e9
        return d


class Residency(Protocol):
    """What the switch asks: bytes read so far, and whether the whole file is cached."""

    @property
    def bytes_read(self) -> int: ...

    def all_resident(self) -> bool: ...


class ResidencySwitch:
    """Decides, pass by pass, whether the eval callback is needed at all.

    While the callback is on and a pass read nothing (every chosen byte was already cached),
    the switch asks ``all_resident``; if the whole file is cached, the callback stays off for
    ``off_passes`` passes (llama.cpp runs untouched), then the file is asked again. A "no"
    (some pages never came back, e.g. experts nobody chose since a cold start) waits twice as
    long before the next question, up to ``max_wait`` passes, so the costly whole-file
    question stays rare. Under memory pressure passes keep reading and it is never asked.
    """

    def __init__(self, source: Residency, off_passes: int = 16, max_wait: int = 64) -> None:
        self.source = source
        self.off_passes = off_passes
        self.max_wait = max_wait
        self.passes_off = 0  # passes run with the callback off
        self.checks = 0  # whole-file residency questions asked
        self._off_left = 0
        self._wait = 0  # passes before the next question may be asked
        self._backoff = 1
        self._read_before = -1  # the first pass asks

    def reset(self) -> None:
        """Forget what was learnt (the caller just dropped the file's pages)."""
        self._off_left = self._wait = 0
        self._backoff = 1
        self._read_before = -1

    def callback_needed(self) -> bool:
        """Call before each forward pass."""
        if self._off_left > 0:
            self._off_left -= 1
            self.passes_off += 1
            return False
        read = self.source.bytes_read
        fresh = self._read_before < 0  # the first pass, or the first after a reset
        quiet = read == self._read_before  # the last pass read nothing
        self._read_before = read
        if self._wait > 0:
            self._wait -= 1
        elif quiet or fresh:
            self.checks += 1
            if self.source.all_resident():
                self._off_left = self.off_passes - 1
                self._backoff = 1
                self.passes_off += 1
                return False
            self._wait = self._backoff
            self._backoff = min(2 * self._backoff, self.max_wait)
        return True


class _DiscardWork:
    """A workload that reads ranges into the engine's buffers and throws the bytes away: the
    point is the page cache the buffered read fills, not the copy."""

    def __init__(self, spans: list[tuple[int, int]]) -> None:
        self.max_length = CHUNK
        self._spans = spans
        self._i = 0
        self.bytes = 0
        self.requests = 0

    def next(self) -> tuple[int, int, int] | None:
        if self._i >= len(self._spans):
            return None
        i = self._i
        self._i += 1
        off, n = self._spans[i]
        return i, off, n

    def complete(self, token: int, data: memoryview, nbytes: int, latency_ns: int) -> None:
        self.bytes += nbytes
        self.requests += 1


@dataclass(frozen=True)
class EngineChoice:
    """The engine and depth the prefetch runs with, and why it differs from what was asked."""

    engine: str
    queue_depth: int
    warning: str | None = None


def choose_engine(engine: str, queue_depth: int) -> EngineChoice:
    """``engine`` at ``queue_depth`` in buffered mode if it can run here; otherwise the nearest
    that can (``threads`` at the same depth, or ``pread``), with a one-line reason.

    An unknown engine name or a depth outside moepack's limits is bad input, not a fallback."""
    eng = get_engine(engine)
    try:
        eng.check(Mode.BUFFERED, queue_depth)
    except BadInput:
        if eng.max_depth is not None and queue_depth > eng.max_depth:
            return EngineChoice(
                "threads",
                queue_depth,
                f"engine {engine!r} runs at queue depth {eng.max_depth} only; prefetching "
                f"with 'threads' at queue depth {queue_depth}",
            )
        raise
    reason = eng.unavailable_reason()
    if reason is None:
        return EngineChoice(engine, queue_depth)
    fallback = "threads" if queue_depth > 1 else "pread"
    return EngineChoice(
        fallback,
        queue_depth,
        f"engine {engine!r} cannot run here ({reason}); prefetching with {fallback!r} "
        f"at queue depth {queue_depth}",
    )


class Prefetcher:
    """Reads chosen experts' non-resident bytes into the page cache before they are used."""

    def __init__(self, model: MoeModel, engine: str = "threads", queue_depth: int = 8) -> None:
        self.layout = ExpertRanges(model)
        self.paths: list[Path] = list(model.shard_paths)
        self.choice = choose_engine(engine, queue_depth)
        self._engine = get_engine(self.choice.engine)
        self.files: list[OpenFile] = [open_file(p, Mode.BUFFERED) for p in self.paths]
        self.stats = PrefetchStats()
        self.residency_known = True
        self.warning = self.choice.warning
        try:
            cachestat(self.files[0].fd, 0, PAGE_SIZE)
        except OSError as e:  # ENOSYS before Linux 6.5, EOPNOTSUPP on some filesystems
            self.residency_known = False
            note = (
                f"cachestat is not available here ({e.strerror}): every chosen expert byte is "
                "read, cached or not"
            )
            self.warning = f"{self.warning}; {note}" if self.warning else note

    @property
    def bytes_read(self) -> int:
        return self.stats.bytes_read

    def all_resident(self) -> bool:
        """Whether every page of every shard is in the page cache: then a whole forward pass
        has nothing to fetch. One cachestat per shard, but it walks every page (12–30 ms for
        3.4 GB here), so callers ask only now and then (see ``ResidencySwitch``)."""
        if not self.residency_known:
            return False
        return all(cachestat(f.fd, 0, 0).nr_cache >= _pages(0, max(f.size, 1)) for f in self.files)

    def _fully_cached(self, r: FileRange) -> bool:
        if not self.residency_known:
            return False
        cs = cachestat(self.files[r.shard].fd, r.offset, r.length)
        return cs.nr_cache >= _pages(r.offset, r.length)

    def prefetch(self, block: int, experts: Iterable[int]) -> None:
        """Make ``experts``' slices of ``block`` resident; return once they are."""
        t0 = perf_counter_ns()
        st = self.stats
        st.calls += 1
        ranges = self.layout.ranges(block, experts)
        wanted = sum(r.length for r in ranges)
        st.ranges += len(ranges)
        st.bytes_wanted += wanted
        by_shard: dict[int, list[tuple[int, int]]] = {}
        for r in ranges:
            for off in range(r.offset, r.end, CHUNK):
                n = min(CHUNK, r.end - off)
                piece = FileRange(r.shard, off, n)
                if self._fully_cached(piece):
                    st.bytes_resident += n
                else:
                    by_shard.setdefault(r.shard, []).append((off, n))
        t1 = perf_counter_ns()
        for shard, spans in by_shard.items():
            work = _DiscardWork(spans)
            self._engine.run(self.files[shard], work, self.choice.queue_depth)
            st.bytes_read += work.bytes
            st.reads += work.requests
        t2 = perf_counter_ns()
        st.ns_reading += t2 - t1
        st.ns_total += t2 - t0

    def close(self) -> None:
        for f in self.files:
            f.close()
