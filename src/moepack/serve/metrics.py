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
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..storage.linux import PAGE_SIZE, cachestat
from .meter import PHASES, Meter, PhaseTotals
from .prefixcache import FAMILIES as PREFIX_CACHE_FAMILIES
from .prefixcache import samples as prefix_cache_samples
from .requestlog import RequestLog

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Samples = list[tuple[tuple[str, ...], float]]


@dataclass(frozen=True)
class Family:
    """One metric family as ``/metrics`` shows it: its name, kind, help and label names."""

    name: str
    kind: str  # "counter" (``_total`` is added to its samples) or "gauge"
    help: str
    labels: tuple[str, ...] = ()


PHASE = ("phase",)
PHASE_WINDOW = ("phase", "window")
WINDOW = ("window",)
KIND = ("kind",)
FAMILIES = tuple(
    Family(*row)
    for row in (
        ("moepack_prefetch_enabled", "gauge", "1 when the expert prefetcher runs (--prefetch)."),
        ("moepack_tokens", "counter", "Tokens llama.cpp computed, per phase.", PHASE),
        ("moepack_compute_seconds", "counter", "Time in llama.cpp passes, per phase.", PHASE),
        (
            "moepack_read_bytes",
            "counter",
            "Bytes the storage delivered to the server process during passes "
            "(/proc/self/io read_bytes: faults, read-around and prefetch reads).",
            PHASE,
        ),
        ("moepack_major_faults", "counter", "Major page faults during passes.", PHASE),
        ("moepack_generations", "counter", "Generations run (one per completion request)."),
        (
            "moepack_tokens_per_second",
            "gauge",
            "Tokens per second of llama.cpp's passes, per phase; window all: the server's "
            "life, last: the last request.",
            PHASE_WINDOW,
        ),
        (
            "moepack_read_bytes_per_token",
            "gauge",
            "Bytes the storage delivered per token.",
            PHASE_WINDOW,
        ),
        ("moepack_major_faults_per_token", "gauge", "Major page faults per token.", PHASE_WINDOW),
        (
            "moepack_prefetch_seconds",
            "counter",
            "Time the prefetcher spent in llama.cpp's eval callback.",
        ),
        (
            "moepack_prefetch_bytes",
            "counter",
            "Expert bytes the prefetcher found missing and had read.",
        ),
        ("moepack_prefetch_passes", "counter", "llama.cpp passes the prefetcher was told of."),
        (
            "moepack_prefetch_passes_cached",
            "counter",
            "Of those, passes run with the callback off: every byte of the model was cached "
            "(nothing to prefetch).",
        ),
        (
            "moepack_prefetch_seconds_per_token",
            "gauge",
            "Prefetcher time per token (prefill and decode).",
            WINDOW,
        ),
        (
            "moepack_expert_hit_ratio",
            "gauge",
            "Chosen experts whose every byte was cached when the router chose them.",
            WINDOW,
        ),
        (
            "moepack_lookahead_precision",
            "gauge",
            "Experts the lookahead speculated that the layer then chose, of those speculated.",
            WINDOW,
        ),
        (
            "moepack_lookahead_recall",
            "gauge",
            "Experts the layers chose that the lookahead had speculated, of those chosen.",
            WINDOW,
        ),
        ("moepack_expert_bytes", "gauge", "Bytes of the model's routed experts."),
        (
            "moepack_expert_cache_budget_bytes",
            "gauge",
            "The prefetcher's expert cache budget (--cache; absent: the kernel's page cache "
            "decides).",
        ),
        (
            "moepack_expert_bytes_resident",
            "gauge",
            "Expert bytes in the page cache now (cachestat).",
        ),
        (
            "moepack_expert_residency_ratio",
            "gauge",
            "Share of the expert bytes in the page cache now.",
        ),
        (
            "moepack_pager_enabled",
            "gauge",
            "1 when the expert pager holds the experts (--pager: memory of moepack's own, "
            "userfaultfd, O_DIRECT reads).",
        ),
        ("moepack_pager_budget_bytes", "gauge", "The experts' memory budget (--memory)."),
        ("moepack_pager_resident_bytes", "gauge", "Expert bytes the pager holds now."),
        (
            "moepack_pager_peak_resident_bytes",
            "gauge",
            "The most expert bytes the pager has held at once (reads in flight too).",
        ),
        ("moepack_pager_read_bytes", "counter", "Expert bytes the pager read (O_DIRECT)."),
        (
            "moepack_pager_moved_pages",
            "counter",
            "Pages the pager placed by UFFDIO_MOVE (the read's own pages, nothing copied).",
        ),
        (
            "moepack_pager_faults",
            "counter",
            "Faults on expert pages that waited for the pager's read.",
        ),
        (
            "moepack_pager_forced_evictions",
            "counter",
            "Expert slices dropped to stay within the budget (beyond the live cache's own "
            "evictions).",
        ),
        (
            "moepack_requests_in_flight",
            "gauge",
            "Completion requests received and not yet answered (queued ones included).",
        ),
        (
            "moepack_requests_queued",
            "gauge",
            "Of those, the ones waiting for the model (in flight, less the one running).",
        ),
        (
            "moepack_time_to_first_token_seconds",
            "gauge",
            "From a request's arrival (waiting for the model included) to its first token; "
            "window all: the mean over the server's life, last: the last request.",
            WINDOW,
        ),
        ("moepack_draft_tokens", "counter", "Tokens drafted, and of them accepted.", KIND),
        (
            "moepack_draft_passes",
            "counter",
            "Decode passes, with drafts (verify) or without.",
            KIND,
        ),
        (
            "moepack_draft_acceptance_ratio",
            "gauge",
            "Drafted tokens accepted, of those drafted.",
        ),
        (
            "moepack_draft_experts_per_verified_batch",
            "gauge",
            "Distinct experts a verification pass chose per MoE layer (read once), against its "
            "rows x top-k (what its tokens one at a time would route).",
            KIND,
        ),
        (
            "moepack_draft_read_bytes_per_accepted_token",
            "gauge",
            "Bytes the storage delivered per decoded token kept (drafts rejected not counted "
            "as tokens).",
        ),
        (
            "moepack_requests",
            "counter",
            "Completion requests answered, per path and status.",
            ("path", "code"),
        ),
        ("moepack_prompt_tokens", "counter", "Prompt tokens of the requests logged."),
        (
            "moepack_prompt_tokens_reused",
            "counter",
            "Of those, the tokens not computed again: kept from the previous request or "
            "restored from the prefix cache (the request log's reused count).",
        ),
    )
) + tuple(Family(*row) for row in PREFIX_CACHE_FAMILIES)
"""Every family ``/metrics`` shows, in the order it shows them: the words are data, the
values are computed by ``ServeCollector.samples``."""


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
        pager: Callable[[], dict[str, Any] | None] | None = None,
        prefix_cache: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        self.meter = meter
        self.requests = requests
        self.residency = residency
        self.prefetching = prefetching
        self.log = log  # the time to first token of the requests logged
        self.budget = budget  # the prefetcher's expert cache budget (None: the kernel's)
        self.drafts = drafts  # the drafts' record (``DraftHook.snapshot``), with --draft
        self.moe_layers = max(1, moe_layers)
        self.pager = pager  # the pager's budget and what it holds now, or None
        self.prefix_cache = prefix_cache  # the prefix cache's figures, or None (off)

    def collect(self) -> Iterator[Metric]:
        values = self.samples()
        for f in FAMILIES:
            if f.name in values:
                kind = CounterMetricFamily if f.kind == "counter" else GaugeMetricFamily
                family = kind(f.name, f.help, labels=list(f.labels))
                for labels, value in values[f.name]:
                    family.add_metric(list(labels), float(value))
                yield family

    def samples(self) -> dict[str, Samples]:
        """Each family's samples now (``FAMILIES`` names and words them); a family left out
        is not shown (a budget the prefetcher does not have, cachestat missing, no drafts)."""
        totals, last, prefetch, last_prefetch, generations = self.meter.read()
        windows = (("all", totals, prefetch), ("last", last, last_prefetch))

        def by_phase(of: Callable[[PhaseTotals], float]) -> Samples:
            return [((p,), of(totals[p])) for p in PHASES]

        def per_window(of: Callable[[PhaseTotals], float]) -> Samples:
            return [((p, w), of(t[p])) for w, t, _ in windows for p in PHASES]

        def of_prefetch(of: Callable[[dict[str, float], dict[str, PhaseTotals]], float]) -> Samples:
            return [((w,), of(p, t)) for w, t, p in windows]

        def ratio(hits: str, of: str) -> Samples:
            return of_prefetch(lambda p, t: _ratio(p.get(hits, 0.0), p.get(of, 0.0)))

        out: dict[str, Samples] = {
            "moepack_prefetch_enabled": [((), float(self.prefetching))],
            "moepack_tokens": by_phase(lambda t: t.tokens),
            "moepack_compute_seconds": by_phase(lambda t: t.ns / 1e9),
            "moepack_read_bytes": by_phase(lambda t: t.read_bytes),
            "moepack_major_faults": by_phase(lambda t: t.major_faults),
            "moepack_generations": [((), generations)],
            "moepack_tokens_per_second": per_window(lambda t: t.tokens_per_second),
            "moepack_read_bytes_per_token": per_window(lambda t: t.per_token(t.read_bytes)),
            "moepack_major_faults_per_token": per_window(lambda t: t.per_token(t.major_faults)),
            "moepack_prefetch_seconds": [((), prefetch.get("seconds_in_callback", 0.0))],
            "moepack_prefetch_bytes": [((), prefetch.get("bytes_read", 0.0))],
            "moepack_prefetch_passes": [((), prefetch.get("passes", 0.0))],
            "moepack_prefetch_passes_cached": [((), prefetch.get("passes_all_resident", 0.0))],
            "moepack_prefetch_seconds_per_token": of_prefetch(
                lambda p, t: _per_token(p.get("seconds_in_callback", 0.0), t)
            ),
            "moepack_expert_hit_ratio": ratio("demand_hits", "demand_experts"),
            "moepack_lookahead_precision": ratio("lookahead_hits", "lookahead_predicted"),
            "moepack_lookahead_recall": ratio("lookahead_hits", "lookahead_chosen"),
            "moepack_expert_bytes": [((), float(self.residency.total))],
            "moepack_requests_in_flight": [((), float(self.requests.in_flight))],
            "moepack_requests": [
                ((path, str(code)), n) for (path, code), n in sorted(self.requests.answered.items())
            ],
        }
        if self.budget is not None:
            out["moepack_expert_cache_budget_bytes"] = [((), float(self.budget))]
        resident = self.residency.resident()
        if resident is not None:
            out["moepack_expert_bytes_resident"] = [((), float(resident))]
            out["moepack_expert_residency_ratio"] = [((), _ratio(resident, self.residency.total))]
        out.update(self._pager_samples(prefetch))
        running = 1 if self.meter.active is not None else 0
        out["moepack_requests_queued"] = [((), float(max(0, self.requests.in_flight - running)))]
        out.update(prefix_cache_samples(self.prefix_cache))
        if self.log is not None:
            prompt, reused = self.log.reuse()
            out["moepack_prompt_tokens"] = [((), float(prompt))]
            out["moepack_prompt_tokens_reused"] = [((), float(reused))]
            last_ttft, mean_ttft = self.log.ttft()
            out["moepack_time_to_first_token_seconds"] = [
                (("all",), mean_ttft),
                (("last",), last_ttft),
            ]
        if self.drafts is not None:
            out.update(self._draft_samples(self.drafts(), totals["decode"]))
        return out

    def _draft_samples(self, d: dict[str, Any], decode: PhaseTotals) -> dict[str, Samples]:
        """Drafting's counters and what a verification batch read (--draft)."""
        passes = d["verify_passes"] * self.moe_layers
        return {
            "moepack_draft_tokens": [(("drafted",), d["drafted"]), (("accepted",), d["accepted"])],
            "moepack_draft_passes": [
                (("verify",), d["verify_passes"]),
                (("single",), d["single_passes"]),
            ],
            "moepack_draft_acceptance_ratio": [((), _ratio(d["accepted"], d["drafted"]))],
            "moepack_draft_experts_per_verified_batch": [
                (("union",), _ratio(d["verify_union_experts"], passes)),
                (("routed",), _ratio(d["verify_routed"], passes)),
            ],
            "moepack_draft_read_bytes_per_accepted_token": [
                ((), decode.per_token(decode.read_bytes))
            ],
        }

    def _pager_samples(self, prefetch: dict[str, float]) -> dict[str, Samples]:
        """The expert pager's figures: its budget and residency now, its reads and faults."""
        now = self.pager() if self.pager is not None else None
        out: dict[str, Samples] = {"moepack_pager_enabled": [((), float(now is not None))]}
        if now is None:
            return out
        for key in ("budget_bytes", "resident_bytes", "peak_resident_bytes"):
            out[f"moepack_pager_{key}"] = [((), float(now[key]))]
        out["moepack_pager_read_bytes"] = [((), prefetch.get("pager_read_bytes", 0.0))]
        out["moepack_pager_moved_pages"] = [((), prefetch.get("pager_moved_pages", 0.0))]
        out["moepack_pager_faults"] = [((), prefetch.get("pager_fault_waits", 0.0))]
        out["moepack_pager_forced_evictions"] = [((), prefetch.get("pager_forced_evictions", 0.0))]
        return out


def _per_token(value: float, phases: dict[str, PhaseTotals]) -> float:
    tokens = sum(t.tokens for t in phases.values())
    return value / tokens if tokens else 0.0


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def registry_of(collector: ServeCollector) -> CollectorRegistry:
    """A registry of its own holding ``collector`` (nothing of the process-wide default)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The text ``/metrics`` answers with."""
    return generate_latest(registry)
