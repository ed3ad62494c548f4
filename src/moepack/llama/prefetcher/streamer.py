"""The expert prefetcher inside a llama.cpp process: llama.cpp's eval callback tells it what
each MoE layer chose, and it has the chosen experts read while the layer computes.

Two modes:

- ``overlap`` (the default): the callback on ``ffn_moe_topk-<il>`` hands the layer's chosen
  slices, in the order its matmuls read them, to the read-ahead thread (``fetcher``) and
  returns at once; llama.cpp computes the first expert while the last is still arriving (a
  fault on a page in flight waits for it, and with ``MADV_RANDOM`` on the expert ranges a
  fault on a page not yet asked for reads only that page). Then it speculates for the next
  layer(s) (``lookahead``), which the thread reads only when no demand waits.
- ``serial``: the callback reads every missing slice itself with a read engine and returns
  once all are in (the prefetcher before overlap; kept to measure against).

Dense bytes (attention, norms, routers, embeddings, shared experts) can be locked in memory
(``pinning``). When the whole file is cached the callback is switched off pass by pass
(``ResidencySwitch``), so a cached model runs as if no callback were set. Nothing here changes
a number llama.cpp computes: only when bytes arrive.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any

import numpy as np

from ...checkpoint.model import MoeModel
from ...errors import BadInput
from ...storage.engine import get_engine
from ...storage.linux import PAGE_SIZE, cachestat, mem_available
from ...stream.budget import CacheBudget
from ...stream.predictor import resolve
from .evalcb import EvalCallback, host_check_address, tensor_offsets
from .fetcher import PyFetcher, make_fetcher, willneed_window
from .lookahead import ROUTER, Lookahead, LookaheadStats, RouterPredictor
from .mapping import file_mappings
from .native import CFetcher, CStream, native_library
from .pager import PAGER_CHOICES, ExpertPager, PagerRefused, budget_shortfall
from .pinning import PinnedRanges, dense_ranges, dense_tensors, pin
from .prefetch import ExpertRanges, Prefetcher, ResidencySwitch, merge_ranges

TOPK = "ffn_moe_topk"
ROUTER_INPUT = "ffn_moe_logits"
MODES = ("overlap", "serial")
_NO_ROWS = np.zeros((0, 4), dtype=np.int64)
PIN_CHOICES = ("auto", "on", "off")
LEVELS = ("resident_pages", "peak_pages", "budget_pages", "total_pages", "spare_pages")
"""The pager's counts that are levels, not sums (in ``pager_report``, not per phase)."""
MARGIN = 256 << 20
"""Memory left out of the automatic cache budget (at least; 5 % when that is more). The
cache's slots are locked: with 96 MiB left, a browser's growth, the benchmarks' memory holder
(its floor) or llama.cpp's own later allocations pushed the machine to its last pages."""


@dataclass(frozen=True)
class StreamOptions:
    """How the prefetcher works.

    ``lookahead``: predictors of later layers' experts (``router``, ``cross-layer``,
    ``markov``, … joined with ``+``; ``none``), ``lookahead_budget`` experts per token and
    layer at most (0: the model's top-k), ``lookahead_depth`` layers ahead; a trace
    (``lookahead_trace``, ids ``[tokens, layers, k]`` already loaded) fits the trace-learned
    predictors, which otherwise learn online. ``pin_dense``: lock the dense bytes in memory
    (``auto``: when the file does not fit in the memory available). ``cache``: the live
    expert cache — a byte budget, shared evenly by the MoE layers, each an LRU of the experts
    its share holds (what ``replay --policy lru`` models); what leaves it is dropped from the
    page cache at once; ``auto``: such a cache of the memory available once the model is
    loaded (less a margin) when the file does not fit in it; ``kernel``: no cache of moepack's,
    the kernel evicts as it likes.

    ``memory``: the experts' resident bytes, a hard bound with the pager (``auto``: the
    memory available once the model is loaded, less a margin); without it the live cache's
    budget. ``pager``: the experts in memory moepack owns (``pager``): ``auto`` when ``memory`` is a
    byte count the model exceeds and userfaultfd works (else the page-cache prefetcher, with
    one warning saying why), ``on`` (refuse to run without it), ``off``.

    ``lookahead`` ``router`` or ``none`` runs in C (``native``) where a compiler is at hand;
    the trace-learned predictors, alone or combined, run in Python (~1 ms per layer)."""

    mode: str = "overlap"
    engine: str = "threads"
    queue_depth: int = 8
    lookahead: str = "router"
    lookahead_budget: int = 0
    lookahead_depth: int = 1
    pin_dense: str = "auto"
    cache: str | int = "auto"
    memory: str | int = "auto"
    pager: str = "auto"

    def validate(self) -> None:
        if self.pager not in PAGER_CHOICES:
            raise BadInput(f"`pager` is one of {', '.join(PAGER_CHOICES)}, not {self.pager!r}")
        if isinstance(self.memory, str) and self.memory != "auto":
            raise BadInput(f"`memory` is a byte count or auto, not {self.memory!r}")
        if isinstance(self.memory, int) and self.memory <= 0:
            raise BadInput(f"the memory budget must be positive, got {self.memory}")
        if self.pager == "on" and self.mode != "overlap":
            raise BadInput("the pager serves overlap mode's reads: `pager` on needs it")
        if self.mode not in MODES:
            raise BadInput(f"prefetch mode is one of {', '.join(MODES)}, not {self.mode!r}")
        if self.pin_dense not in PIN_CHOICES:
            raise BadInput(
                f"`pin_dense` is one of {', '.join(PIN_CHOICES)}, not {self.pin_dense!r}"
            )
        if isinstance(self.cache, str) and self.cache not in ("auto", "kernel"):
            raise BadInput(f"`cache` is a byte count, auto or kernel, not {self.cache!r}")
        if isinstance(self.cache, int) and self.cache <= 0:
            raise BadInput(f"the cache budget must be positive, got {self.cache}")
        if self.lookahead_budget < 0 or not 1 <= self.lookahead_depth <= 4:
            raise BadInput("`lookahead_budget` must be >= 0 and `lookahead_depth` 1 to 4")
        get_engine(self.engine)  # an unknown name is bad input in every mode
        if self.lookahead not in ("", "none"):
            names = [p.strip() for p in self.lookahead.split("+")]
            rest = "+".join(n for n in names if n != ROUTER)
            if rest:
                resolve(rest)


def wants_pager(options: StreamOptions, file_bytes: int, available: int) -> bool:
    """Whether the pager should take the experts over (before asking userfaultfd): ``on``;
    ``auto`` where the model exceeds the ``memory`` asked for or, with ``memory`` auto, the
    memory ``available`` (measured the fastest engine for a model that does not fit:
    ``llama.runtime.choice``); never ``off``."""
    if options.pager == "off":
        return False
    if options.pager == "on":
        return True
    if isinstance(options.memory, int):
        return file_bytes > options.memory
    return file_bytes > available


def live_cache_reserve(options: StreamOptions, layout: ExpertRanges, top_k: int) -> int:
    """The pager's bytes left out of the live cache (``memory`` less this is the cache's
    budget): room for one layer's demand and the lookahead's, ``(1 + depth) x budget``
    experts of the largest layer (what ``fit`` prices a token's reads with)."""
    depth = options.lookahead_depth if options.lookahead not in ("", "none") else 0
    largest = max(layout.expert_bytes(b) for b in layout.blocks)
    return (1 + depth) * (options.lookahead_budget or top_k) * largest


def live_cache_slots(budget: int, layout: ExpertRanges, top_k: int) -> list[int]:
    """The live cache's experts per MoE layer in ``budget`` bytes, shared evenly by the
    layers (``BadInput`` when a layer would hold fewer than ``top_k``)."""
    blocks = layout.blocks
    per_expert = [layout.expert_bytes(b) for b in blocks]
    n_expert = [layout.n_expert[b] for b in blocks]
    return CacheBudget(bytes=max(budget, 1)).slots_per_layer(per_expert, top_k, n_expert)


def check_pager_budget(
    path: str | os.PathLike[str], options: StreamOptions | None, threads: int
) -> None:
    """Refuse, before llama.cpp loads anything, a pager asked for (``pager`` on) with a
    ``memory`` budget it cannot make progress in at ``threads`` compute threads (``BadInput``
    naming the minimum; ``pager`` auto falls back to the page cache instead, with a warning)."""
    if options is None or options.pager != "on" or not isinstance(options.memory, int):
        return
    with MoeModel(path) as model:
        short = budget_shortfall(options.memory, ExpertRanges(model), threads)
    if short is not None:
        raise BadInput(short, path)


class ExpertStreamer:
    """The prefetcher for one model (any shard of it) in the process that runs llama.cpp."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        options: StreamOptions = StreamOptions(),
        *,
        lookahead_ids: np.ndarray | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        options.validate()
        self.options = options
        self._warn = warn or (lambda message: None)
        with MoeModel(path) as model:  # closed before llama.cpp maps the file
            self.paths = list(model.shard_paths)
            self.layout = ExpertRanges(model)
            self.expert_ranges = [
                r for b in self.layout.blocks for r in self.layout.whole_tensors(b)
            ]
            self.dense_by_name = dense_tensors(model)
            self.dense = dense_ranges(model)
            self.file_bytes = model.file_bytes
            self.top_k = model.top_k
            self.serial: Prefetcher | None = None
            self.fetcher: CFetcher | PyFetcher | None = None
            self.lookahead: Lookahead | None = None
            self.cstream: CStream | None = None
            names = {p.strip() for p in options.lookahead.split("+")} - {"", "none"}
            native = native_library() if options.mode == "overlap" else None
            budget = options.lookahead_budget or model.top_k
            router = RouterPredictor(model) if names == {ROUTER} and native else None
            if options.mode == "serial":
                self.serial = Prefetcher(model, options.engine, options.queue_depth)
            elif names and (native is None or names != {ROUTER}):
                self.lookahead = Lookahead(
                    model, options.lookahead, budget, options.lookahead_depth, lookahead_ids
                )
        if self.serial is not None and self.serial.warning:
            self._warn(self.serial.warning)
        self.fds = [os.open(p, os.O_RDONLY) for p in self.paths]
        self.cachestat_works = True
        try:
            cachestat(self.fds[0], 0, PAGE_SIZE)
        except OSError as e:  # ENOSYS before Linux 6.5, EOPNOTSUPP on some filesystems
            self.cachestat_works = False
            self._warn(
                f"cachestat is not available here ({e.strerror}): every chosen expert byte is "
                "asked for, cached or not, and the callback stays on when the file is cached"
            )
        if self.serial is None:
            self.fetcher = make_fetcher(
                self.fds, willneed_window(self.paths[0]), self.cachestat_works
            )
        self.switch = ResidencySwitch(self) if self.cachestat_works else None
        wants_input = router is not None or (
            self.lookahead is not None and self.lookahead.router is not None
        )
        self.callback = EvalCallback(
            [TOPK],
            self._on_tensor,
            defer={ROUTER_INPUT: "router_input"} if wants_input else None,
            flush_at="read",
            inputs={ROUTER_INPUT: 1} if wants_input else None,
        )
        self._router_input: dict[int, np.ndarray] = {}
        self._on_choice: Callable[[int, np.ndarray], None] | None = None
        if native is not None and isinstance(self.fetcher, CFetcher) and self.lookahead is None:
            self._native_hook(native, router, budget, 0 if not names else options.lookahead_depth)
        self.pager: ExpertPager | None = None
        self.pager_note: str | None = None  # why the pager does not hold the experts
        self.pinned: PinnedRanges | None = None
        self.cache_slots: list[int] = []
        self.cache_budget = 0
        self.readaround_bytes = 0
        self.calls = 0
        self.ns_callback = 0
        self.passes = 0
        self.union_experts = 0  # distinct chosen experts per layer and pass, summed
        self.routed = 0  # rows x top-k per layer and pass, summed

    def _native_hook(
        self, lib: Any, router: RouterPredictor | None, budget: int, depth: int
    ) -> None:
        """Demand (and pre-gating) in C, inside the eval gate: no Python on the way."""
        assert isinstance(self.fetcher, CFetcher)
        weights = {}
        if router is not None:
            weights = {
                b: (w, router.norm.get(b), router.bias.get(b)) for b, w in router.weights.items()
            }
        blocks = [(b, self.layout.n_expert[b], self.layout.table(b)) for b in self.layout.blocks]
        slot = self.callback.slot_index(ROUTER_INPUT) if router is not None else -1
        self.cstream = CStream(
            lib,
            self.fetcher,
            blocks,
            weights,
            budget,
            depth,
            slot,
            tensor_offsets(),
            host_check_address(),
        )
        if not self.callback.set_hook(TOPK, self.cstream.address or 0, self.cstream.handle, False):
            self.cstream.close()  # no C gate here: the Python handler does the work
            self.cstream = None

    @property
    def on_choice(self) -> Callable[[int, np.ndarray], None] | None:
        """Also told every layer's choice (a traced run records it)."""
        return self._on_choice

    @on_choice.setter
    def on_choice(self, fn: Callable[[int, np.ndarray], None] | None) -> None:
        self._on_choice = fn
        if self.cstream is not None:  # Python is told of the reads only when it records
            self.callback.set_hook(
                TOPK, self.cstream.address or 0, self.cstream.handle, fn is not None
            )

    # -- after llama.cpp has loaded the model ------------------------------------------------

    def attach(self, *, threads: int, copied: Collection[str] = ()) -> None:
        """Take the experts over (the pager), pin the dense bytes, size the live cache (call
        once llama.cpp has loaded the model, before it computes; ``threads``: the most
        threads llama.cpp computes with, each of which the pager keeps a slice for;
        ``copied``: dense tensors llama.cpp copied out of the mapping at load, its repacked
        layouts, whose file pages nothing reads: locking them would hold them twice)."""
        pin_it = self.options.pin_dense == "on" or (
            self.options.pin_dense == "auto" and self.file_bytes > mem_available()
        )
        skip = frozenset(copied)
        self.dense = merge_ranges([r for n, r in self.dense_by_name.items() if n not in skip])
        pinned = sum(r.length for r in self.dense) if pin_it else 0
        self._start_pager(pinned, threads)  # before pinning maps the file a second time
        if pin_it and self.dense:
            self.pinned = pin(self.paths, self.dense)
        self._start_cache()

    def _start_pager(self, pinned: int, threads: int) -> None:
        """The experts into memory of moepack's own under the budget, where it can be
        (``pinned``: dense bytes about to be locked, left out of an automatic budget)."""
        want, memory = self.options.pager, self.options.memory
        available = mem_available()
        if not wants_pager(self.options, self.file_bytes, available):
            return
        try:
            if not isinstance(self.fetcher, CFetcher):
                raise PagerRefused(
                    "the pager serves the C read-ahead thread's work (overlap mode and a C "
                    "compiler)"
                )
            if isinstance(memory, int):
                budget = memory
            else:
                free = available - pinned
                budget = free - max(MARGIN, free // 20)
            self.pager = ExpertPager(
                self.paths, self.layout, budget, self.options.queue_depth, threads=threads
            )
        except PagerRefused as e:
            if want == "on":
                raise BadInput(f"`pager` is on, but {e}") from None
            self.pager_note = str(e)
            self._warn(f"{e}; the page-cache prefetcher runs instead")
            return
        lib = native_library()
        assert lib is not None
        self.pager.attach(self.fetcher, lib)

    def _reserve(self) -> int:
        """Pager bytes left out of the live cache: a layer's demand and the lookahead's."""
        return live_cache_reserve(self.options, self.layout, self.top_k)

    def _start_cache(self) -> None:
        """Size the live expert cache and tell the hook where llama.cpp maps the file."""
        if self.cstream is None or self.options.cache == "kernel":
            if self.options.cache not in ("auto", "kernel"):
                self._warn(
                    "the live expert cache needs the C hook (a C compiler) and the router or "
                    "no lookahead: the kernel decides what stays cached"
                )
            return
        available = mem_available()
        memory = self.options.memory
        if self.pager is not None:  # inside the pager's budget, beside its reads in flight
            budget = self.pager.asked - self._reserve()
            if isinstance(self.options.cache, int):
                budget = min(budget, self.options.cache)
        elif self.options.cache == "auto" and isinstance(memory, int):
            budget = memory  # no pager: the budget is the live cache's, the kernel's to keep
        elif self.options.cache == "auto":
            if self.file_bytes <= available:
                return  # the whole file fits: nothing to manage
            budget = available - max(MARGIN, available // 20)
        else:
            budget = int(self.options.cache)
        try:
            slots = live_cache_slots(budget, self.layout, self.top_k)
        except BadInput as e:
            if self.pager is not None:
                self._warn(f"{e.message}: the pager's own LRU decides what stays")
                return
            if self.options.cache != "auto":
                raise
            self._warn(f"{e.message}: the kernel decides what stays cached")
            return
        assert isinstance(self.fetcher, CFetcher)
        for shard, path in enumerate(self.paths):
            for start, end, offset in file_mappings(path):
                if offset == 0:  # llama.cpp maps each file whole
                    self.fetcher.set_mapping(shard, start, end - start)
        self.cache_slots = slots
        self.cache_budget = budget
        self.cstream.set_capacities(slots)

    # -- the residency switch asks these ----------------------------------------------------

    @property
    def bytes_read(self) -> int:
        """Expert bytes asked for so far (the switch watches it change)."""
        if self.serial is not None:
            return self.serial.stats.bytes_read
        if self.pager is not None:
            return self.pager.stats.read_bytes
        assert self.fetcher is not None
        st = self.fetcher.stats
        return st.demand_missing + st.spec_missing

    def all_resident(self) -> bool:
        """Whether every page of every shard is cached (one walk of the page cache), or held
        by the pager."""
        held = 0
        if self.pager is not None:
            ps = self.pager.stats
            if ps.resident_pages < ps.total_pages:
                return False
            held = ps.total_pages * PAGE_SIZE
        cached = sum(cachestat(fd, 0, 0).nr_cache * PAGE_SIZE for fd in self.fds)
        return cached + held >= sum(os.fstat(fd).st_size for fd in self.fds)

    def before_pass(self) -> None:
        """Call before each ``llama_decode``: the callback is switched off while the whole
        file is cached."""
        self.passes += 1
        if self.switch is not None:
            self.callback.enabled = self.switch.callback_needed()

    def after_pass(self) -> None:
        """Call after each ``llama_decode`` (re-raises what the read-ahead thread raised)."""
        self.callback.raise_pending()
        if self.fetcher is not None:
            self.fetcher.demand(-1, _NO_ROWS)  # surfaces a thread error without waiting

    def cold_start(self) -> None:
        """The caller just dropped the file's pages: forget that it was cached."""
        if self.pager is not None:
            self.pager.drop_all()
        if self.switch is not None:
            self.switch.reset()
        if self.cstream is not None and self.cache_slots:
            self.cstream.set_capacities(self.cache_slots)  # empty, as the page cache is

    # -- inside llama.cpp's compute ------------------------------------------------------------

    def _on_tensor(self, name: str, block: int, arr: np.ndarray) -> None:
        if name == ROUTER_INPUT:
            self._router_input[block] = arr
            return
        if self._on_choice is not None:
            self._on_choice(block, arr)
        if self.cstream is not None:  # the demand hook did the rest before Python was told
            return
        t0 = perf_counter_ns()
        self.calls += 1
        ids = np.asarray(arr, dtype=np.int64)
        chosen = {int(e) for e in np.unique(ids)}
        self.union_experts += len(chosen)
        self.routed += ids.size
        if self.serial is not None:
            self.serial.prefetch(block, chosen)
        else:
            assert self.fetcher is not None
            self.fetcher.demand(block, self.layout.slice_rows(block, chosen))
            if self.lookahead is not None:
                self._speculate(block, ids, chosen)
        self.ns_callback += perf_counter_ns() - t0

    def _speculate(self, block: int, ids: np.ndarray, chosen: set[int]) -> None:
        la = self.lookahead
        assert la is not None and self.fetcher is not None
        for read in self.fetcher.drain_spec():
            la.record_read(*read)
        la.judge(block, chosen)
        la.observe(block, ids)
        x = self._router_input.pop(block, None)
        for target, experts in la.predict(block, x, ids.shape[0], chosen).items():
            self.fetcher.speculate(target, self.layout.slice_rows(target, experts))

    # -- the record ------------------------------------------------------------------------

    def batch_counts(self) -> tuple[int, int]:
        """(distinct experts chosen, rows x top-k), per MoE layer and pass, summed so far:
        a pass of several tokens reads the union of their experts once, so the two differ by
        what a verification batch shares. Cheap (no wait for the read-ahead thread)."""
        if self.cstream is not None:
            per, _hook = self.cstream.stats()
            return (
                sum(c["union_experts"] for c in per.values()),
                sum(c["routed"] for c in per.values()),
            )
        return self.union_experts, self.routed

    def snapshot(self) -> dict[str, float]:
        """Flat counters (summable, subtractable) for a phase's measurements, once the
        read-ahead thread has sent what it was given (its counts are then complete)."""
        if self.fetcher is not None:
            self.fetcher.wait_idle()
        calls, ns = self.calls, self.ns_callback
        cache = {"cache_accesses": 0, "cache_hits": 0, "cache_evictions": 0}
        spec = {"lookahead_predicted": 0, "lookahead_hits": 0, "lookahead_chosen": 0}
        if self.cstream is not None:
            per, hook = self.cstream.stats()
            calls, ns = hook["calls"], hook["ns"]
            for c in per.values():
                cache["cache_accesses"] += c["accesses"]
                cache["cache_hits"] += c["cache_hits"]
                cache["cache_evictions"] += c["evictions"]
                spec["lookahead_predicted"] += c["predicted"]
                spec["lookahead_hits"] += c["hits"]
                spec["lookahead_chosen"] += c["chosen"]
        elif self.lookahead is not None:
            for la in self.lookahead.stats.layers.values():
                spec["lookahead_predicted"] += la.predicted
                spec["lookahead_hits"] += la.hits
                spec["lookahead_chosen"] += la.chosen
        out: dict[str, float] = {
            "calls": calls,
            "bytes_read": self.bytes_read,
            "passes": self.passes,
            "passes_all_resident": self.switch.passes_off if self.switch else 0,
            "residency_checks": self.switch.checks if self.switch else 0,
            "seconds_in_callback": ns / 1e9,
            "union_experts": self.batch_counts()[0],
            "routed": self.batch_counts()[1],
            **cache,
            **spec,
        }
        if self.serial is not None:
            for k, v in self.serial.stats.to_json().items():
                out[f"serial_{k}"] = v
            out["calls_read"] = self.serial.stats.reads
        if self.pager is not None:
            ps = self.pager.stats
            for k, v in ps.to_json().items():
                if k.startswith(("demand_", "spec_", "evicted_")):
                    out[k] = v
                elif k not in LEVELS:
                    out[f"pager_{k}"] = v
            out["calls_read"] = ps.reads
        elif self.fetcher is not None:
            for k, v in self.fetcher.stats.to_json().items():
                out[k] = v
            out["calls_read"] = self.fetcher.stats.willneed_calls
        return out

    def pager_report(self) -> dict[str, Any] | None:
        """The pager's budget and what it holds now (levels, not counters)."""
        if self.pager is None:
            return None
        ps = self.pager.stats
        return {
            "userfaultfd": self.pager.how,
            "o_direct": self.pager.direct,
            "queue_depth": self.pager.queue_depth,
            "budget_bytes": self.pager.budget,
            "threads": self.pager.threads,  # each keeps the slice it computes on
            "expert_bytes": self.pager.expert_bytes,
            "resident_bytes": ps.resident_pages * PAGE_SIZE,
            "peak_resident_bytes": ps.peak_pages * PAGE_SIZE,
            # UFFDIO_MOVE (the read's pages into place, evicted ones reused) or UFFDIO_COPY
            "placing": "move" if ps.spare_pages else "copy",
            "spare_bytes": ps.spare_pages * PAGE_SIZE,
        }

    def report(self) -> dict[str, Any]:
        """What stays the same for the whole run: mode, pins, advice, lookahead record."""
        out: dict[str, Any] = {
            "mode": self.options.mode,
            "pinned_bytes": self.pinned.bytes if self.pinned else 0,
            "dense_bytes": sum(r.length for r in self.dense),
            "no_readaround_bytes": self.readaround_bytes,
            "callback": self.callback.kind,
            "willneed_window": self.fetcher.window if self.fetcher else None,
            "fetcher": self.fetcher.kind if self.fetcher else None,
            "cache": {
                "policy": "lru" if self.cache_slots else "kernel",
                "budget_bytes": self.cache_budget if self.cache_slots else None,
                "slots_per_layer": self.cache_slots or None,
            },
            "lookahead": None,
            "pager": self.pager_report(),
            "pager_fallback": self.pager_note,
        }
        stats: LookaheadStats | None = self.lookahead.stats if self.lookahead else None
        if self.cstream is not None:
            per, hook = self.cstream.stats()
            out["hook"] = hook
            if self.options.lookahead not in ("", "none"):
                stats = LookaheadStats.from_counts(per)
        if stats is not None:
            out["lookahead"] = {
                "predictors": self.options.lookahead,
                "budget": self.options.lookahead_budget or self.top_k,
                "depth": self.options.lookahead_depth,
                **stats.to_json(),
            }
        if self.serial is not None:
            out["engine"] = self.serial.choice.engine
            out["queue_depth"] = self.serial.choice.queue_depth
        return out

    def release_pager(self) -> None:
        """Give the experts back to the file mapping (call before llama.cpp frees the model:
        the pager maps the file back at the same addresses)."""
        if self.pager is not None:
            self.pager.release()

    def close(self) -> None:
        if self.cstream is not None:
            self.callback.set_hook(TOPK, 0, 0, True)
            self.cstream.close()
            self.cstream = None
        self.release_pager()
        if self.fetcher is not None:
            self.fetcher.close()
        if self.serial is not None:
            self.serial.close()
        if self.pinned is not None:
            self.pinned.close()
        for fd in self.fds:
            os.close(fd)
        self.fds = []
