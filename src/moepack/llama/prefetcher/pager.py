"""The expert pager: memory moepack owns for llama.cpp's routed experts, under a hard budget.

With the page cache holding the experts, the kernel decides how much memory they take (what
other programs leave), what stays (its own LRU over pages the live cache meant to keep), and
each token pays it to allocate, fill and reclaim page-cache pages. The pager takes the expert
bytes out of the page cache on stock llama.cpp, without a patch:

- after llama.cpp has mapped the model, the whole pages inside every routed-expert tensor of
  its mapping are replaced by anonymous memory (``MAP_FIXED`` at the same addresses, so every
  pointer llama.cpp holds stays valid), registered with **userfaultfd** in missing-page mode;
  the partial pages at a tensor's edges stay file-backed (``repack --align`` files have none);
- a touched page that is not resident waits in the kernel until the pager's C thread
  (``csrc/pager.c``: a Python thread would need the GIL while llama.cpp's threads fault) has
  read its expert slice with ``O_DIRECT`` into aligned buffers and placed it
  (``UFFDIO_COPY``): never zeros. The read-ahead hook's demand and lookahead go to the pager
  instead of ``WILLNEED`` (``moepack_fetcher_pager``), so slices are usually placed before
  the fault; a fault on a slice nobody asked for is served first, whole slice;
- resident expert bytes (reads in flight included) never exceed the budget: demand and faults
  evict the least recently used slices (``MADV_DONTNEED``), speculation only uses what is
  free, and the live cache's own evictions (``--cache``'s LRU, what ``replay`` models) drop
  slices as before;
- it never waits for ever: each thread llama.cpp computes with keeps the slice it last
  faulted on (``minimum_budget``), a fault that no read can make room for ends the process
  with one line, and an interrupt (the worker's signal wakeup pipe) ends it while faults wait
  on reads that do not come back.

Where userfaultfd is refused (``vm.unprivileged_userfaultfd``, seccomp, no access to
``/dev/userfaultfd``) or llama.cpp did not map the model, ``PagerRefused`` says why in one
line and the streamer falls back to the page-cache prefetcher. ``release`` maps the file back
over every region before llama.cpp frees its model, so a ``Llama`` outlives its pager.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from ... import interrupts
from ...pages import drop_cached
from ...storage.linux import PAGE_SIZE
from .cbuild import compile_library
from .mapping import file_mappings
from .native import CFetcher
from .prefetch import ExpertRanges

PAGER_CHOICES = ("off", "auto", "on")
CHUNK = 1 << 20
"""Largest single read (one reader thread, one ``UFFDIO_COPY``)."""
MAX_THREADS = 4096
"""The most compute threads the pager keeps a slice for (``MAX_GUARDS`` of ``csrc/pager.c``)."""
HOW = {1: "userfaultfd, user-mode only", 2: "userfaultfd", 3: "/dev/userfaultfd"}
I64_MAX = (1 << 63) - 1


class PagerRefused(Exception):
    """The pager cannot take the experts over here; the message says why and what to change."""


@dataclass
class PagerStats:
    """The pager's counters (``struct pstats`` of ``csrc/pager.c``, in order)."""

    demand_experts: int = 0
    demand_hits: int = 0  # experts none of whose pages was missing when their demand arrived
    demand_pieces: int = 0
    demand_bytes: int = 0
    demand_missing: int = 0  # bytes of demand not resident: read
    spec_pieces: int = 0
    spec_bytes: int = 0
    spec_missing: int = 0  # speculative bytes read
    spec_dropped: int = 0  # speculative pieces dropped unsent (the real choice came first)
    spec_refused: int = 0  # speculative pieces not read: no free room in the budget
    evicted_pieces: int = 0  # slices dropped by the live cache (its victims, vain speculation)
    evicted_bytes: int = 0
    forced_evictions: int = 0  # slices dropped to stay within the budget
    forced_bytes: int = 0
    faults: int = 0  # userfaultfd events
    fault_waits: int = 0  # faults on pages not yet read or in flight: a read was sent for them
    faults_unasked: int = 0  # of those, on a slice never asked for before
    faults_stale: int = 0  # events for pages already placed (woken)
    faults_dropped: int = 0  # faults on pages dropped behind the pager's back (read again)
    reads: int = 0
    read_bytes: int = 0
    ns_reading: int = 0  # summed over the reader threads
    copies: int = 0
    ns_copying: int = 0  # inside UFFDIO_COPY
    errors: int = 0  # failed reads (read again) and copies into ranges that went away
    resident_pages: int = 0
    peak_pages: int = 0
    budget_pages: int = 0
    total_pages: int = 0
    moved_pages: int = 0  # placed by UFFDIO_MOVE: the read's own pages, nothing copied
    recycled_pages: int = 0  # evicted pages moved into the spare pool for the next reads
    spare_pages: int = 0  # the spare pool's size (resident and counted when full); 0: copies
    guard_releases: int = 0  # a thread's slice let go: a fault found no room otherwise
    demand_dropped: int = 0  # demand pieces not read: no room beside the threads' slices

    def to_json(self) -> dict[str, int | float]:
        d: dict[str, int | float] = dict(asdict(self))
        d["seconds_reading"] = self.ns_reading / 1e9
        d["seconds_copying"] = self.ns_copying / 1e9
        return d


class _PagerStatsC(ctypes.Structure):
    _fields_ = [(f.name, ctypes.c_int64) for f in fields(PagerStats)]


def pager_library() -> ctypes.CDLL | None:
    """``csrc/pager.c`` built and loaded with its signatures, or None (no C compiler)."""
    lib = compile_library("pager", flags=("-pthread",))
    if lib is None:
        return None
    vp, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.moepack_pager_uffd_open.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.moepack_pager_uffd_open.restype = i32
    lib.moepack_pager_new.argtypes = [i32, vp, i32, i32, vp, i32, i64, i32, i64, i32, i32]
    lib.moepack_pager_new.restype = vp
    lib.moepack_pager_take_over.argtypes = [vp, vp]
    lib.moepack_pager_take_over.restype = i32
    lib.moepack_pager_push.argtypes = [vp, ctypes.c_int32, ctypes.c_int32, vp, i64]
    lib.moepack_pager_push.restype = i32
    lib.moepack_pager_wait_idle.argtypes = [vp]
    lib.moepack_pager_wait_idle.restype = None
    lib.moepack_pager_drop_all.argtypes = [vp]
    lib.moepack_pager_drop_all.restype = None
    lib.moepack_pager_drain.argtypes = [vp, vp, i64]
    lib.moepack_pager_drain.restype = i64
    lib.moepack_pager_stats.argtypes = [vp, ctypes.POINTER(_PagerStatsC), i64]
    lib.moepack_pager_stats.restype = i32
    lib.moepack_pager_region.argtypes = [vp, i32, ctypes.POINTER(ctypes.c_int64)]
    lib.moepack_pager_region.restype = i64
    lib.moepack_pager_pool.argtypes = [vp, i32, ctypes.POINTER(ctypes.c_int64)]
    lib.moepack_pager_pool.restype = i64
    lib.moepack_pager_free.argtypes = [vp, vp, i32]
    lib.moepack_pager_free.restype = None
    return lib


def open_userfaultfd(lib: ctypes.CDLL) -> tuple[int, str]:
    """A userfaultfd and how it was had; ``PagerRefused`` saying what to change."""
    how = ctypes.c_int(0)
    fd = lib.moepack_pager_uffd_open(ctypes.byref(how))
    if fd >= 0:
        return fd, HOW.get(how.value, "userfaultfd")
    err = -fd
    if err in (errno.EPERM, errno.EACCES):
        raise PagerRefused(
            f"userfaultfd is refused here ({errno.errorcode.get(err, err)}): set "
            "vm.unprivileged_userfaultfd=1, give this user read-write access to "
            "/dev/userfaultfd, or run with CAP_SYS_PTRACE"
        )
    raise PagerRefused(
        f"userfaultfd is not available here ({os.strerror(err)}): a Linux kernel with "
        "CONFIG_USERFAULTFD (and no seccomp filter refusing it) is needed"
    )


def llama_bases(paths: Sequence[Path]) -> list[int]:
    """The address of file offset 0 in llama.cpp's one mapping of each shard."""
    bases = []
    for path in paths:
        found = {start - offset for start, _end, offset in file_mappings(path)}
        if not found:
            raise PagerRefused(
                f"{path}: llama.cpp did not map the model (use_mmap off?): nothing to page"
            )
        if len(found) > 1:
            raise PagerRefused(f"{path}: the model is mapped {len(found)} times here")
        bases.append(found.pop())
    return bases


def expert_regions(layout: ExpertRanges, bases: Sequence[int]) -> np.ndarray:
    """int64 ``[tensors, 6]``: shard, layer, experts, slice bytes, tensor offset, mapping base
    of every routed-expert matrix, sorted by shard and offset (as the C side searches)."""
    rows = []
    for block in layout.blocks:
        n = layout.n_expert[block]
        for shard, base, size in layout.table(block).tolist():
            rows.append((shard, block, n, size, base, bases[shard]))
    rows.sort(key=lambda r: (r[0], r[4]))
    return np.array(rows, dtype=np.int64).reshape(-1, 6)


def _interior(offset: int, length: int) -> tuple[int, int]:
    lo = -(-offset // PAGE_SIZE) * PAGE_SIZE
    return lo, max(lo, (offset + length) // PAGE_SIZE * PAGE_SIZE)


def slice_span(layout: ExpertRanges) -> int:
    """The most bytes of whole pages one expert slice can take: its size in pages, and one
    more (a slice need not start on a page)."""
    largest = max(int(layout.table(b)[:, 2].max()) for b in layout.blocks)
    return (-(-largest // PAGE_SIZE) + 1) * PAGE_SIZE


def minimum_budget(layout: ExpertRanges, threads: int) -> int:
    """The smallest budget in which the pager always makes progress: one slice for each of
    llama.cpp's compute ``threads``.

    llama.cpp's MUL_MAT_ID runs gate, up and down as three graph nodes; inside each, every
    thread works through its chunks of one chosen expert's slice, then moves on to the next
    expert (no barrier between experts), so at any moment each thread reads one slice,
    however many experts a layer or a batch chose. A thread's last faulted slice is kept
    until it faults elsewhere, so with room for ``threads`` slices a fault always finds room
    once the reads in flight land. Reads in flight, the spare pool, demand and speculation
    only take room that is free (a read takes its pages from the spare pool first), so they
    add nothing here; they make a budget this small slow, not stuck."""
    return max(1, threads) * slice_span(layout)


def budget_shortfall(budget: int, layout: ExpertRanges, threads: int) -> str | None:
    """Why ``budget`` is too small for the pager at ``threads`` (naming the minimum), or None."""
    low = minimum_budget(layout, threads)
    if budget >= low:
        return None
    return (
        f"a memory budget of {budget:,} bytes is below the pager's minimum for this model at "
        f"{threads} compute thread(s), {low:,} bytes (each thread keeps the expert slice it "
        f"computes on, up to {slice_span(layout):,} bytes of pages): give `memory` {low} or "
        "more, or fewer `threads`"
    )


def _open_direct(path: Path) -> tuple[int, bool]:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT), True
    except OSError as e:
        if e.errno != errno.EINVAL:  # O_DIRECT is not for this filesystem: buffered, dropped
            raise
    return os.open(path, os.O_RDONLY), False


class ExpertPager:
    """The experts of one model (every shard) in llama.cpp's mapping, paged by moepack."""

    def __init__(
        self,
        paths: Sequence[Path],
        layout: ExpertRanges,
        budget: int,
        queue_depth: int = 8,
        chunk: int = CHUNK,
        threads: int = 1,
    ) -> None:
        """``threads``: llama.cpp's compute threads (the most that may fault at once)."""
        lib = pager_library()
        if lib is None:
            raise PagerRefused("the pager is C and there is no C compiler here")
        threads = max(1, min(int(threads), MAX_THREADS))
        short = budget_shortfall(budget, layout, threads)
        if short is not None:
            raise PagerRefused(short)
        self._lib = lib
        self.paths = list(paths)
        self.regions = expert_regions(layout, llama_bases(self.paths))
        self._fds: list[int] = []
        self._buffered: list[int] = []
        self._handle: int | None = None
        self._attached: tuple[CFetcher, ctypes.CDLL] | None = None
        self.uffd = -1
        self.uffd, self.how = open_userfaultfd(lib)
        try:
            self.direct = True
            for p in self.paths:
                fd, direct = _open_direct(p)
                self._fds.append(fd)
                self.direct = self.direct and direct
                self._buffered.append(os.open(p, os.O_RDONLY))
            fds = (ctypes.c_int * len(self._fds))(*self._fds)
            self._buffered_arr = (ctypes.c_int * len(self._buffered))(*self._buffered)
            self.queue_depth = max(1, min(int(queue_depth), 64))
            stop = interrupts.wakeup_fd()
            handle = lib.moepack_pager_new(
                self.uffd,
                fds,
                len(self._fds),
                int(self.direct),
                self.regions.ctypes.data,
                self.regions.shape[0],
                min(budget, I64_MAX),  # the C side holds it to what can ever be resident
                self.queue_depth,
                max(PAGE_SIZE, min(chunk, slice_span(layout))),
                threads,
                -1 if stop is None else stop,
            )
            if not handle:
                raise MemoryError("could not set up the expert pager")
            rc = lib.moepack_pager_take_over(handle, self._buffered_arr)
            if rc:
                lib.moepack_pager_free(handle, self._buffered_arr, 0)
                raise PagerRefused(
                    f"the expert ranges of llama.cpp's mapping cannot be taken over "
                    f"({os.strerror(rc)})"
                )
            self._handle = handle
        except BaseException:
            self._close_fds()
            raise
        st = self.stats
        self.asked = budget
        # what can ever be resident: every expert page and a full spare pool (2**63-1 asked)
        self.budget = min(budget, (st.total_pages + st.spare_pages) * PAGE_SIZE)
        self.threads = threads
        self.expert_bytes = st.total_pages * PAGE_SIZE
        # the page cache's copies of those ranges are no one's now
        for shard, _layer, n, size, off, _base in self.regions.tolist():
            lo, hi = _interior(off, n * size)
            if hi > lo:
                drop_cached(self._buffered[shard], lo, hi - lo)

    def attach(self, fetcher: CFetcher, stream_lib: ctypes.CDLL) -> None:
        """From now on ``fetcher``'s pushes (the demand hook's, Python's) come here."""
        assert self._handle is not None and fetcher._handle is not None
        fn = ctypes.cast
        stream_lib.moepack_fetcher_pager.argtypes = [ctypes.c_void_p] * 5
        stream_lib.moepack_fetcher_pager.restype = None
        stream_lib.moepack_fetcher_pager(
            fetcher._handle,
            fn(self._lib.moepack_pager_push, ctypes.c_void_p),
            fn(self._lib.moepack_pager_drain, ctypes.c_void_p),
            fn(self._lib.moepack_pager_wait_idle, ctypes.c_void_p),
            self._handle,
        )
        self._attached = (fetcher, stream_lib)

    def _detach(self) -> None:
        """The fetcher's pushes go back to its own thread (once what it gave has landed)."""
        if self._attached is not None:
            fetcher, stream_lib = self._attached
            if fetcher._handle is not None:
                stream_lib.moepack_fetcher_pager(fetcher._handle, None, None, None, None)
            self._attached = None

    @property
    def active(self) -> bool:
        return self._handle is not None

    @property
    def stats(self) -> PagerStats:
        out = _PagerStatsC()
        if self._handle is not None and self._lib.moepack_pager_stats(
            self._handle, ctypes.byref(out), ctypes.sizeof(out)
        ):
            raise RuntimeError("the pager's counters do not match")
        return PagerStats(*(int(getattr(out, f.name)) for f in fields(PagerStats)))

    def push(self, layer: int, kind: int, rows: np.ndarray) -> None:
        """Work as the hook gives it: rows ``(shard, expert, offset, length)``; kind 0 demand,
        1 speculation, 2 evict."""
        assert self._handle is not None
        rows = np.ascontiguousarray(rows, dtype=np.int64).reshape(-1, 4)
        if self._lib.moepack_pager_push(self._handle, layer, kind, rows.ctypes.data, len(rows)):
            raise MemoryError("the pager could not queue its work")

    def wait_idle(self) -> None:
        if self._handle is not None:
            self._lib.moepack_pager_wait_idle(self._handle)

    def drop_all(self) -> None:
        """Every resident expert page dropped (a cold start)."""
        if self._handle is not None:
            self._lib.moepack_pager_drop_all(self._handle)

    def ranges(self) -> list[tuple[int, int]]:
        """``(address, length)`` of every region the pager holds, and of its read buffers and
        spare pool where it moves pages (their pages are in its resident count too)."""
        out: list[tuple[int, int]] = []
        if self._handle is None:
            return out
        n = ctypes.c_int64(0)
        for k in range(self.regions.shape[0]):
            addr = self._lib.moepack_pager_region(self._handle, k, ctypes.byref(n))
            if addr:
                out.append((int(addr), int(n.value)))
        for which in (0, 1):
            addr = self._lib.moepack_pager_pool(self._handle, which, ctypes.byref(n))
            if addr:
                out.append((int(addr), int(n.value)))
        return out

    def _still_mapped(self) -> bool:
        """Whether llama.cpp's mapping is still there (our anonymous regions in it): mapping
        the file back over freed addresses would clobber whatever reused them."""
        spans = []
        for line in Path("/proc/self/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) >= 5 and parts[4] == "0":
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                spans.append((lo, hi))
        spans.sort()
        for addr, length in self.ranges():
            if not any(lo <= addr and addr + length <= hi for lo, hi in spans):
                return False
        return True

    def release(self) -> None:
        """Stop the threads, map the file back over every region (when llama.cpp's mapping
        is still there), let go of the userfaultfd. Idempotent."""
        self._detach()
        if self._handle is not None:
            restore = self._still_mapped()
            self._lib.moepack_pager_free(self._handle, self._buffered_arr, int(restore))
            self._handle = None
        self._close_fds()

    def _close_fds(self) -> None:
        for fd in [*self._fds, *self._buffered]:
            os.close(fd)
        self._fds, self._buffered = [], []
        if self.uffd >= 0:
            os.close(self.uffd)
            self.uffd = -1


def smaps_resident(ranges: Sequence[tuple[int, int]]) -> int:
    """Resident bytes of this process's mappings inside ``ranges`` (``/proc/self/smaps``'s
    ``Rss``): what the kernel counts, to hold the pager's own count against. Ranges that
    touch count as one: the kernel merges their mappings (the spare pool and the read
    buffers, alike and side by side, are one mapping in smaps)."""
    spans: list[list[int]] = []
    for a, n in sorted(ranges):
        if spans and a <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], a + n)
        else:
            spans.append([a, a + n])
    total = 0
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = any(a <= lo and hi <= b for a, b in spans)
        elif inside and head == "Rss:":
            total += int(line.split()[1]) * 1024
    return total
