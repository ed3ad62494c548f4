"""``moepack replay``: a trace through an expert cache, the misses read for real, cold.

Per trace layer a policy's cache of the budget's slots sees every routed expert in trace
order (``simulate``); every miss is read from the source file (a GGUF at a layout's offsets
or an expert-major store, ``sources``) through a read engine at a queue depth, and its bytes
are copied into the cache's slot, so the process holds what a runtime would: the cache (and
a predictor's read-ahead buffer), never the model. Reads are cold as ``storage.cold`` makes
them for both replays (O_DIRECT, or buffered with the file's pages dropped before every token
and the first drop confirmed with cachestat).
Tokens are read in chunks of ``CHUNK_TOKENS`` (the queue drains at each chunk's end), so the
request lists stay bounded too.
"""

from __future__ import annotations

import mmap
import resource
import sys
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any

import numpy as np

from ..errors import BadInput
from ..pages import drop_cached
from ..progress import NULL_PROGRESS, ProgressSink
from ..storage.cold import NOT_COLD_NOTE, ColdStream, cold_engine, drop_and_confirm, widen_spans
from ..storage.modes import Mode, OpenFile, open_file
from ..trace.cache_policy import POLICIES
from ..trace.core import RoutingTrace
from .budget import CacheBudget
from .forecast import fit, prompt_starts
from .simulate import HitRates, LayerRun, run_layer
from .sources import ExpertFile

CHUNK_TOKENS = 2048
MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python 3.11's mmap has no name for it


@dataclass(frozen=True)
class ReplayOptions:
    """The cache, the read path and the read-ahead of one replay."""

    budget: CacheBudget
    policy: str = "lru"
    engine: str = "threads"
    queue_depth: int = 8
    mode: Mode = Mode.DIRECT
    predictor: str | None = None
    prefetch_budget: int | None = None  # experts read ahead per token and layer (default k)


@dataclass(frozen=True)
class ReadAheadStats:
    """The read-ahead: experts read ahead, how many a token then used (precision), and the
    share of the cache's misses they covered (usefulness)."""

    predictor: str
    budget: int
    issued: int
    useful: int
    misses: int

    @property
    def precision(self) -> float:
        return self.useful / self.issued if self.issued else 0.0

    @property
    def usefulness(self) -> float:
        return self.useful / self.misses if self.misses else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "predictor": self.predictor,
            "budget": self.budget,
            "issued": self.issued,
            "useful": self.useful,
            "misses": self.misses,
            "precision": self.precision,
            "usefulness": self.usefulness,
        }


@dataclass(kw_only=True)
class StreamReplayResult:
    """What streaming a trace's experts through the cache cost, measured."""

    source: str
    kind: str
    layout: str
    trace: str
    policy: str
    budget: CacheBudget
    slots: list[int]
    cache_bytes: int
    readahead_bytes: int
    tokens: int
    rates: HitRates
    requests: int
    requested_bytes: int
    device_bytes: int
    demand_bytes: int
    seconds: float
    engine: str
    mode: str
    queue_depth: int
    cold_confirmed: bool | None
    peak_rss: int
    prefetch: ReadAheadStats | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def bytes_per_token(self) -> float:
        return self.requested_bytes / self.tokens

    @property
    def requests_per_token(self) -> float:
        return self.requests / self.tokens

    @property
    def gbps(self) -> float:
        return self.device_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def io_seconds_per_token(self) -> float:
        return self.seconds / self.tokens

    @property
    def tokens_per_second_bound(self) -> float | None:
        """Tokens/s if reading were the only cost (None: nothing was read)."""
        return self.tokens / self.seconds if self.seconds > 0 else None

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "kind": self.kind,
            "layout": self.layout,
            "trace": self.trace,
            "policy": self.policy,
            "budget": self.budget.to_json(),
            "slots_per_layer": self.slots,
            "cache_bytes": self.cache_bytes,
            "readahead_bytes": self.readahead_bytes,
            "tokens": self.tokens,
            "hit_rate": self.rates.to_json(),
            "requests": self.requests,
            "requests_per_token": self.requests_per_token,
            "requested_bytes": self.requested_bytes,
            "device_bytes": self.device_bytes,
            "demand_bytes": self.demand_bytes,
            "bytes_per_token": self.bytes_per_token,
            "seconds": self.seconds,
            "achieved_gbps": self.gbps,
            "io_us_per_token": self.io_seconds_per_token * 1e6,
            "fetch_limited_tokens_per_s": self.tokens_per_second_bound,
            "engine": self.engine,
            "mode": self.mode,
            "queue_depth": self.queue_depth,
            "cold_confirmed": self.cold_confirmed,
            "peak_rss": self.peak_rss,
            "prefetch": self.prefetch.to_json() if self.prefetch else None,
            "notes": list(self.notes),
        }


@dataclass
class _LayerReads:
    """One layer's simulated lookups and where its reads land in the arena."""

    run: LayerRun
    ahead: int  # experts read ahead per token (0: no prefetch)
    cache_base: int
    ahead_base: int
    expert_bytes: int


class _CopyStream(ColdStream):
    """``ColdStream`` that copies each read's bytes into its place in the arena (request ``i``
    of the issue order to ``dest[i]``)."""

    def __init__(
        self,
        f: OpenFile,
        spans: list[np.ndarray],
        drop: bool,
        arena: memoryview,
        dest: np.ndarray,
        skip: np.ndarray,
        length: np.ndarray,
    ) -> None:
        super().__init__(f, spans, drop)
        self.arena = arena
        self.dest, self.skip, self.length = dest.tolist(), skip.tolist(), length.tolist()

    def complete(self, token: int, data: memoryview, nbytes: int, latency_ns: int) -> None:
        super().complete(token, data, nbytes, latency_ns)
        d, s, n = self.dest[token], self.skip[token], self.length[token]
        self.arena[d : d + n] = data[s : s + n]


def _plan_layers(
    trace: RoutingTrace,
    rows: tuple[int, int],
    src: ExpertFile,
    slots: list[int],
    opts: ReplayOptions,
    fit_rows: np.ndarray | None,
    progress: ProgressSink,
) -> tuple[list[_LayerReads], int, int, list[str]]:
    ids = np.asarray(trace.ids[rows[0] : rows[1]])
    held_out = fit_rows is not None
    train = np.asarray(trace.ids[fit_rows]) if fit_rows is not None else ids
    policy = POLICIES.get(opts.policy)
    notes: list[str] = []
    fitted = None
    budget = 0
    starts = prompt_starts(trace, np.arange(rows[0], rows[1]))
    if opts.predictor:
        budget = min(opts.prefetch_budget or trace.k, trace.n_expert)
        if budget < 1:
            raise BadInput(f"a prefetch budget is at least 1 expert, got {budget}")
        fitted = fit(opts.predictor, train, trace.n_expert)
        if not held_out:
            notes.append(
                f"predictor {opts.predictor} was fitted on the replayed tokens themselves "
                "(`holdout_prompts` fits it on other prompts)"
            )
    if policy.learns and not held_out:
        notes.append(f"{policy.name}'s hot set was learned from the replayed tokens (an oracle)")
    layers: list[_LayerReads] = []
    cursor = 0
    progress.start("simulating the cache", len(slots), unit="layers")
    for layer, cap in enumerate(slots):
        eb = src.expert_bytes(layer)
        layer_ids = np.asarray(ids[:, layer, :])
        learned = policy.fit(np.asarray(train[:, layer, :]), trace.n_expert, cap)
        ranked = None
        if fitted is not None:  # deep enough to find ``budget`` not resident
            ranked = fitted.rank_layer(ids, starts, layer, min(trace.n_expert, cap + budget))
        run = run_layer(policy, layer_ids, cap, trace.n_expert, learned, ranked, budget)
        del ranked
        layers.append(_LayerReads(run, budget, cursor, 0, eb))
        cursor += cap * eb
        progress.advance(1)
    progress.finish()
    cache_bytes = cursor
    for lay in layers:
        if lay.ahead:
            lay.ahead_base = cursor
            cursor += lay.ahead * lay.expert_bytes
    return layers, cache_bytes, cursor - cache_bytes, notes


def _chunk_requests(
    ids: np.ndarray, src: ExpertFile, layers: list[_LayerReads], a: int, b: int
) -> dict[str, np.ndarray]:
    """The reads of tokens ``[a, b)``, in execution order: per token, per layer, the
    read-ahead then the misses, each expert's parts in order."""
    cols: dict[str, list[np.ndarray]] = {
        k: [] for k in ("tok", "layer", "kind", "off", "len", "dest", "demand")
    }
    for li, lay in enumerate(layers):
        run = lay.run
        slots = run.slots[a:b]
        need = slots >= 0
        if run.covered is not None:
            need &= ~run.covered[a:b]
        t, s = np.nonzero(need)
        experts = ids[a + t, li, s].astype(np.int64)
        dest = lay.cache_base + slots[t, s].astype(np.int64) * lay.expert_bytes
        groups = [(t, experts, dest, 1)]
        if run.issued is not None:
            tp, j = np.nonzero(run.issued[a:b] >= 0)
            ep = run.issued[a + tp, j].astype(np.int64)
            groups.append((tp, ep, lay.ahead_base + j.astype(np.int64) * lay.expert_bytes, 0))
        offs, lens = src.offsets[li], src.lengths[li]
        for tt, ee, dd, kind in groups:
            if tt.size == 0:
                continue
            start = np.zeros(len(ee), dtype=np.int64)
            for p in range(offs.shape[1]):
                cols["tok"].append(tt)
                cols["layer"].append(np.full(tt.size, li))
                cols["kind"].append(np.full(tt.size, kind * 16 + p))
                cols["off"].append(offs[ee, p])
                cols["len"].append(lens[ee, p])
                cols["dest"].append(dd + start)
                cols["demand"].append(np.full(tt.size, kind == 1))
                start = start + lens[ee, p]
    if not cols["tok"]:
        empty = np.zeros(0, dtype=np.int64)
        return {k: empty for k in cols}
    out = {k: np.concatenate(v) for k, v in cols.items()}
    order = np.lexsort((out["kind"], out["layer"], out["tok"]))
    return {k: v[order] for k, v in out.items()}


def _populate(arena: mmap.mmap) -> None:
    """Fault the cache's pages in before the clock starts, as a runtime allocates its cache
    up front (a first touch inside a read's completion would be timed as reading)."""
    populate = getattr(mmap, "MADV_POPULATE_WRITE", MADV_POPULATE_WRITE)
    if sys.platform == "linux":
        try:
            arena.madvise(populate)
            return
        except OSError:
            pass
    zero = bytes(mmap.PAGESIZE)
    for off in range(0, len(arena), mmap.PAGESIZE):
        arena[off : off + len(zero)] = zero[: len(arena) - off]


def replay(
    trace: RoutingTrace,
    src: ExpertFile,
    options: ReplayOptions,
    token_range: tuple[int, int] | None = None,
    progress: ProgressSink = NULL_PROGRESS,
    fit_rows: np.ndarray | None = None,
) -> StreamReplayResult:
    """Replay ``trace`` (already checked against the source) through the cache, reading for
    real; ``token_range`` replays only those tokens, from an empty cache. Pinned sets and the
    predictor learn from the tokens ``fit_rows`` (default: the replayed ones)."""
    lo, hi = token_range or (0, trace.tokens)
    ids = np.asarray(trace.ids[lo:hi])
    if ids.shape[0] == 0:
        raise BadInput("no tokens to replay (the trace or its chosen range is empty)")
    eng = cold_engine(options.engine, options.mode)
    eng.check(options.mode, options.queue_depth)
    n_layers = trace.layers
    slots = options.budget.slots_per_layer(
        [src.expert_bytes(i) for i in range(n_layers)], trace.k, [trace.n_expert] * n_layers
    )
    layers, cache_bytes, ahead_bytes, notes = _plan_layers(
        trace, (lo, hi), src, slots, options, fit_rows, progress
    )
    hits = np.stack([lay.run.hits for lay in layers], axis=1)
    rates = HitRates.of(hits, trace.phase_mask("decode")[lo:hi])
    arena = mmap.mmap(-1, max(1, cache_bytes + ahead_bytes))
    _populate(arena)
    view = memoryview(arena)
    requests = requested = device = demand = 0
    seconds = 0.0
    tokens = ids.shape[0]
    try:
        with open_file(src.path, options.mode) as f:
            src.release()
            confirmed = drop_and_confirm(f, src.regions)
            progress.start("replaying", tokens, unit="tokens")
            for a in range(0, tokens, CHUNK_TOKENS):
                b = min(tokens, a + CHUNK_TOKENS)
                req = _chunk_requests(ids, src, layers, a, b)
                spans = np.stack([req["off"], req["len"]], axis=1)
                wide = widen_spans(spans, f.offset_align, f.size)
                cuts = np.searchsorted(req["tok"], np.arange(1, b - a))
                per_token = np.split(wide, cuts)
                work = _CopyStream(
                    f,
                    per_token,
                    options.mode is Mode.BUFFERED,
                    view,
                    req["dest"],
                    spans[:, 0] - wide[:, 0],
                    req["len"],
                )
                if a and options.mode is Mode.BUFFERED:
                    drop_cached(f.fd)
                t0 = perf_counter_ns()
                eng.run(f, work, options.queue_depth)
                seconds += (perf_counter_ns() - t0) / 1e9
                requests += int(req["len"].size)
                requested += int(req["len"].sum())
                demand += int(req["len"][req["demand"]].sum())
                device += int(wide[:, 1].sum())
                progress.advance(b - a)
    finally:
        progress.finish()
        view.release()
        arena.close()
    prefetch = None
    if options.predictor:
        issued = sum(
            int((lay.run.issued >= 0).sum()) for lay in layers if lay.run.issued is not None
        )
        useful = sum(int(lay.run.covered.sum()) for lay in layers if lay.run.covered is not None)
        misses = sum(int((lay.run.slots >= 0).sum()) for lay in layers)
        prefetch = ReadAheadStats(options.predictor, layers[0].ahead, issued, useful, misses)
    if confirmed is False:
        notes.append(NOT_COLD_NOTE)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return StreamReplayResult(
        source=src.label,
        kind=src.kind,
        layout=src.layout,
        trace=trace.label(),
        policy=POLICIES.get(options.policy).name,
        budget=options.budget,
        slots=slots,
        cache_bytes=cache_bytes,
        readahead_bytes=ahead_bytes,
        tokens=tokens,
        rates=rates,
        requests=requests,
        requested_bytes=requested,
        device_bytes=device,
        demand_bytes=demand,
        seconds=seconds,
        engine=eng.name,
        mode=options.mode.value,
        queue_depth=options.queue_depth,
        cold_confirmed=confirmed,
        peak_rss=peak,
        prefetch=prefetch,
        notes=notes,
    )
