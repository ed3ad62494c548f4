"""``/metrics``: the served model's measurements in Prometheus text format (``prometheus-client``).

What a user needs to see whether streaming helps, the same for a server with and without
``--prefetch``: tokens/s of prefill and decode, the bytes the device delivered and the major
page faults per token, the prefetcher's time per token, how much of the expert bytes sits in
the page cache right now (``cachestat`` on the model's shards), requests in flight. Counters
(``_total``) are for rates over time; the per-token and per-second gauges are over the whole
life of the server and, labelled ``window="last"``, over the last finished request.

Everything is read at scrape time from the ``Meter`` and the page cache, never from llama.cpp:
``/metrics`` answers while a generation runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..storage.linux import PAGE_SIZE, cachestat
from .meter import PHASES, Meter, PhaseTotals
from .requestlog import RequestLog

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class RequestCounts:
    """Completion requests in flight and answered, per path and status (kept by ``guard``)."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.answered: dict[tuple[str, int], int] = {}

    def started(self) -> None:
        self.in_flight += 1

    def finished(self, path: str, status: int) -> None:
        self.in_flight -= 1
        self.answered[(path, status)] = self.answered.get((path, status), 0) + 1


class ExpertResidency:
    """Expert bytes of the model and how many of them are in the page cache now."""

    def __init__(self, paths: Sequence[os.PathLike[str] | str], ranges: Sequence[Any]) -> None:
        self.fds = [os.open(p, os.O_RDONLY) for p in paths]
        self.ranges = [(int(r.shard), int(r.offset), int(r.length)) for r in ranges]
        self.total = sum(n for _s, _o, n in self.ranges)
        self.works = True

    def resident(self) -> int | None:
        """Expert bytes cached now (None where cachestat is missing)."""
        if not self.works:
            return None
        try:
            pages = sum(cachestat(self.fds[s], o, n).nr_cache for s, o, n in self.ranges)
        except OSError:
            self.works = False
            return None
        return min(self.total, pages * PAGE_SIZE)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


class ServeCollector(Collector):
    """The metric families of one server, built at every scrape."""

    def __init__(
        self,
        meter: Meter,
        requests: RequestCounts,
        residency: ExpertResidency,
        prefetching: bool,
        *,
        log: RequestLog | None = None,
        budget: int | None = None,
        drafts: Callable[[], dict[str, Any]] | None = None,
        moe_layers: int = 1,
    ) -> None:
        self.meter = meter
        self.requests = requests
        self.residency = residency
        self.prefetching = prefetching
        self.log = log  # the time to first token of the requests logged
        self.budget = budget  # the prefetcher's expert cache budget (None: the kernel's)
        self.drafts = drafts  # the drafts' record (``DraftHook.snapshot``), with --draft
        self.moe_layers = max(1, moe_layers)

    def collect(self) -> Iterator[Metric]:
        totals, last, prefetch, last_prefetch, generations = self.meter.read()
        yield _gauge("moepack_prefetch_enabled", "1 when the expert prefetcher runs (--prefetch).",
                     [((), float(self.prefetching))])  # fmt: skip
        yield _counter("moepack_tokens", "Tokens llama.cpp computed, per phase.",
                       [((p,), totals[p].tokens) for p in PHASES], ["phase"])  # fmt: skip
        yield _counter("moepack_compute_seconds", "Time in llama.cpp passes, per phase.",
                       [((p,), totals[p].ns / 1e9) for p in PHASES], ["phase"])  # fmt: skip
        yield _counter("moepack_read_bytes",
                       "Bytes the storage delivered to the server process during passes "
                       "(/proc/self/io read_bytes: faults, read-around and prefetch reads).",
                       [((p,), totals[p].read_bytes) for p in PHASES], ["phase"])  # fmt: skip
        yield _counter("moepack_major_faults", "Major page faults during passes.",
                       [((p,), totals[p].major_faults) for p in PHASES], ["phase"])  # fmt: skip
        yield _counter("moepack_generations", "Generations run (one per completion request).",
                       [((), generations)])  # fmt: skip
        windows = (("all", totals, prefetch), ("last", last, last_prefetch))
        yield _gauge("moepack_tokens_per_second", "Tokens per second of llama.cpp's passes, "
                     "per phase; window all: the server's life, last: the last request.",
                     [((p, w), t[p].tokens_per_second) for w, t, _ in windows for p in PHASES],
                     ["phase", "window"])  # fmt: skip
        yield _gauge("moepack_read_bytes_per_token", "Bytes the storage delivered per token.",
                     [((p, w), t[p].per_token(t[p].read_bytes)) for w, t, _ in windows
                      for p in PHASES], ["phase", "window"])  # fmt: skip
        yield _gauge("moepack_major_faults_per_token", "Major page faults per token.",
                     [((p, w), t[p].per_token(t[p].major_faults)) for w, t, _ in windows
                      for p in PHASES], ["phase", "window"])  # fmt: skip
        yield _counter("moepack_prefetch_seconds",
                       "Time the prefetcher spent in llama.cpp's eval callback.",
                       [((), prefetch.get("seconds_in_callback", 0.0))])  # fmt: skip
        yield _counter("moepack_prefetch_bytes",
                       "Expert bytes the prefetcher found missing and had read.",
                       [((), prefetch.get("bytes_read", 0.0))])  # fmt: skip
        yield _counter("moepack_prefetch_passes", "llama.cpp passes the prefetcher was told of.",
                       [((), prefetch.get("passes", 0.0))])  # fmt: skip
        yield _counter("moepack_prefetch_passes_cached",
                       "Of those, passes run with the callback off: every byte of the model "
                       "was cached (nothing to prefetch).",
                       [((), prefetch.get("passes_all_resident", 0.0))])  # fmt: skip
        yield _gauge("moepack_prefetch_seconds_per_token",
                     "Prefetcher time per token (prefill and decode).",
                     [((w,), _per_token(p.get("seconds_in_callback", 0.0), t))
                      for w, t, p in windows], ["window"])  # fmt: skip
        yield _gauge("moepack_expert_hit_ratio",
                     "Chosen experts whose every byte was cached when the router chose them.",
                     [((w,), _ratio(p.get("demand_hits", 0.0), p.get("demand_experts", 0.0)))
                      for w, _t, p in windows], ["window"])  # fmt: skip
        yield _gauge("moepack_lookahead_precision",
                     "Experts the lookahead speculated that the layer then chose, of those "
                     "speculated.",
                     [((w,), _ratio(p.get("lookahead_hits", 0.0), p.get("lookahead_predicted", 0.0)))
                      for w, _t, p in windows], ["window"])  # fmt: skip
        yield _gauge("moepack_lookahead_recall",
                     "Experts the layers chose that the lookahead had speculated, of those chosen.",
                     [((w,), _ratio(p.get("lookahead_hits", 0.0), p.get("lookahead_chosen", 0.0)))
                      for w, _t, p in windows], ["window"])  # fmt: skip
        yield _gauge("moepack_expert_bytes", "Bytes of the model's routed experts.",
                     [((), float(self.residency.total))])  # fmt: skip
        if self.budget is not None:
            yield _gauge("moepack_expert_cache_budget_bytes",
                         "The prefetcher's expert cache budget (--cache; absent: the kernel's "
                         "page cache decides).", [((), float(self.budget))])  # fmt: skip
        resident = self.residency.resident()
        if resident is not None:
            yield _gauge("moepack_expert_bytes_resident",
                         "Expert bytes in the page cache now (cachestat).",
                         [((), float(resident))])  # fmt: skip
            yield _gauge("moepack_expert_residency_ratio",
                         "Share of the expert bytes in the page cache now.",
                         [((), _ratio(resident, self.residency.total))])  # fmt: skip
        yield _gauge("moepack_requests_in_flight",
                     "Completion requests received and not yet answered (queued ones included).",
                     [((), float(self.requests.in_flight))])  # fmt: skip
        running = 1 if self.meter.active is not None else 0
        yield _gauge("moepack_requests_queued",
                     "Of those, the ones waiting for the model (in flight, less the one running).",
                     [((), float(max(0, self.requests.in_flight - running)))])  # fmt: skip
        if self.log is not None:
            last_ttft, mean_ttft = self.log.ttft()
            yield _gauge("moepack_time_to_first_token_seconds",
                         "From a request's arrival (waiting for the model included) to its first "
                         "token; window all: the mean over the server's life, last: the last "
                         "request.", [(("all",), mean_ttft), (("last",), last_ttft)],
                         ["window"])  # fmt: skip
        if self.drafts is not None:
            yield from self._draft_metrics(self.drafts(), totals["decode"])
        yield _counter("moepack_requests", "Completion requests answered, per path and status.",
                       [((path, str(code)), n) for (path, code), n in
                        sorted(self.requests.answered.items())], ["path", "code"])  # fmt: skip

    def _draft_metrics(self, d: dict[str, Any], decode: PhaseTotals) -> Iterator[Metric]:
        """Drafting's counters and what a verification batch read (--draft)."""
        vp, layers = d["verify_passes"], self.moe_layers
        yield _counter("moepack_draft_tokens", "Tokens drafted, and of them accepted.",
                       [(("drafted",), d["drafted"]), (("accepted",), d["accepted"])],
                       ["kind"])  # fmt: skip
        yield _counter("moepack_draft_passes", "Decode passes, with drafts (verify) or without.",
                       [(("verify",), vp), (("single",), d["single_passes"])],
                       ["kind"])  # fmt: skip
        yield _gauge("moepack_draft_acceptance_ratio", "Drafted tokens accepted, of those drafted.",
                     [((), _ratio(d["accepted"], d["drafted"]))])  # fmt: skip
        yield _gauge("moepack_draft_experts_per_verified_batch",
                     "Distinct experts a verification pass chose per MoE layer (read once), "
                     "against its rows x top-k (what its tokens one at a time would route).",
                     [(("union",), _ratio(d["verify_union_experts"], vp * layers)),
                      (("routed",), _ratio(d["verify_routed"], vp * layers))],
                     ["kind"])  # fmt: skip
        yield _gauge("moepack_draft_read_bytes_per_accepted_token",
                     "Bytes the storage delivered per decoded token kept (drafts rejected "
                     "not counted as tokens).",
                     [((), decode.per_token(decode.read_bytes))])  # fmt: skip


def _per_token(value: float, phases: dict[str, PhaseTotals]) -> float:
    tokens = sum(t.tokens for t in phases.values())
    return value / tokens if tokens else 0.0


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _counter(
    name: str, doc: str, samples: list[tuple[tuple[str, ...], float]], labels: Sequence[str] = ()
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=list(labels))
    for values, value in samples:
        family.add_metric(list(values), float(value))
    return family


def _gauge(
    name: str, doc: str, samples: list[tuple[tuple[str, ...], float]], labels: Sequence[str] = ()
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    for values, value in samples:
        family.add_metric(list(values), float(value))
    return family


def registry_of(collector: ServeCollector) -> CollectorRegistry:
    """A registry of its own holding ``collector`` (nothing of the process-wide default)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The text ``/metrics`` answers with."""
    return generate_latest(registry)
