"""How much of a token's reads the streaming engines hide behind its compute.

The pager reads a layer's chosen experts (and, through the router lookahead, the next
layer's) beside the compute, so a token takes at least the longer of its reads and its
compute — the overlapped bound ``1 / max(io, compute)`` — and about their sum at worst. Where
it lands depends on the machine: how soon a layer's first slice arrives, how often the
lookahead is right, and whether the compute threads leave a core to the readers and the page
placing. So a token's time is

    max(io, compute) + (1 - share) * min(io, compute)

with ``share`` the part of the shorter term the overlap hides (negative where streaming costs
more than the sum: the pager's placing and faults on the compute's cores), measured per
engine and per "compute on every core" or "a core left over": ``benchmarks/bench_fit.py
--overlap`` runs a small generated model of a real per-layer shape cached and streamed in
turns, fits the shares and keeps them per CPU in ``<cache>/fit/overlap-<cpu>.json``; without
that file the shares below (``DEFAULT``, and said so in every report) are used.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..cachedir import cache_dir
from .device import save_json

FORMAT = "moepack-fit-overlap/1"
ENGINES = ("pager", "page cache")


@dataclass(frozen=True)
class Overlap:
    """The share of the shorter of reads and compute hidden, per engine and thread setting
    (``spare``: fewer compute threads than cores; ``all``: compute on every core)."""

    pager_spare: float
    pager_all: float
    page_cache_spare: float
    page_cache_all: float
    source: str  # where the shares come from
    measured: str = ""
    cells: int = 0  # runs they were fitted to

    def share(self, engine: str, all_cores: bool) -> float:
        if engine == "pager":
            return self.pager_all if all_cores else self.pager_spare
        return self.page_cache_all if all_cores else self.page_cache_spare

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["format"] = FORMAT
        return out


DEFAULT = Overlap(
    pager_spare=0.6,
    pager_all=0.4,
    page_cache_spare=0.1,
    page_cache_all=0.0,
    source=(
        "moepack's provisional shares, not measured on this CPU: the pager's were not "
        "measurable on the 2-core machine they were written on (a load of 15-20: cached "
        "compute moved 1.7x between rounds); the page-cache prefetcher's from bench_run.py "
        "(5.33 tok/s against a sum of 5.16 and a bound of 9.28); benchmarks/bench_fit.py "
        "--overlap measures them here"
    ),
)
"""Used where ``bench_fit.py --overlap`` has not measured this CPU. The pager's are a prior:
a core to spare leaves the readers and the placing their own core and the router lookahead
reads part of the next layer ahead (hiding more), every core computing shares them."""


def overlapped(io: float, compute: float, share: float) -> float:
    """Seconds of a pass whose reads (``io`` seconds) run beside its compute: the longer,
    and what the overlap does not hide of the shorter."""
    return max(io, compute) + (1.0 - share) * min(io, compute)


def fitted_share(cells: list[tuple[float, float, float]]) -> float:
    """The share that best explains measured passes ``(io, compute, seconds)``: the least
    median |log error| over a grid of hundredths from -1 (streaming costs the shorter term
    twice over: reads that stop the compute, placing that takes its core) to 1 (the bound)."""
    if not cells:
        raise ValueError("no cells to fit")
    best, best_err = 0.0, math.inf
    for i in range(-100, 101):
        share = i / 100
        errs = sorted(abs(math.log(overlapped(io, c, share) / s)) for io, c, s in cells if s > 0)
        err = errs[len(errs) // 2]
        if err < best_err:
            best, best_err = share, err
    return best


def overlap_path(cpu: str) -> Path:
    key = hashlib.sha256(cpu.encode()).hexdigest()[:16]
    return cache_dir() / "fit" / f"overlap-{key}.json"


def overlap_factors(cpu: str) -> Overlap:
    """The shares measured on this CPU (``bench_fit.py --overlap``), else ``DEFAULT``."""
    path = overlap_path(cpu)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("format") != FORMAT:
            return DEFAULT
        body = {k: v for k, v in doc.items() if k != "format"}
        return Overlap(**body)
    except (OSError, ValueError, TypeError, AttributeError):
        return DEFAULT


def save_overlap(cpu: str, overlap: Overlap) -> Path:
    path = overlap_path(cpu)
    save_json(path, overlap.to_json())
    return path
