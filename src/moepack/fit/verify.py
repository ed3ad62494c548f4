"""``fit --verify``: run the model as ``run`` runs it with the flags ``fit`` was given (none:
what a user gets), and set what was measured beside what was estimated.

The memory is made scarce the way the benchmarks make it (``moepack.memhold``: a child
holds the rest of RAM, anonymous and touched, and lets go at once if the machine runs short)
when a memory available was given; every run is a fresh llama.cpp process from a cold start
(the model's own pages dropped, nothing machine-wide), as ``benchmarks/bench_real.py`` runs
them, feeding the same prompt and continuation. What run chose (engine, budget, threads) is
read back from its own record and compared with what ``fit`` said it would choose.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..checkpoint.model import find_shards
from ..memhold import FLOOR, MIN_FLOOR, MemoryHold
from ..pages import drop_cached
from ..storage.linux import mem_available
from .calibrate import filler_text
from .estimate import SLOW_TPS, MemoryPoint

SLACK = 512 << 20  # below this much more than asked, holding is not worth it
BUDGET_TOLERANCE = 0.05  # a budget this close to the estimate's is the same choice


@dataclass(frozen=True)
class Figure:
    name: str  # "run decode", ...
    estimated: tuple[float, float]
    measured: float

    @property
    def error(self) -> float:
        """Measured against the estimate: 0 inside its range, else relative to the nearer
        end (positive: faster than estimated)."""
        lo, hi = self.estimated
        if lo <= self.measured <= hi:
            return 0.0
        end = lo if self.measured < lo else hi
        return self.measured / end - 1 if end > 0 else float("inf")

    def to_json(self) -> dict[str, Any]:
        return {
            "figure": self.name,
            "estimated": {"low": self.estimated[0], "high": self.estimated[1]},
            "measured": self.measured,
            "error": self.error,
        }


@dataclass
class FitVerification:
    available: int  # what was left while the runs ran
    held: int  # bytes the holder held (0: none needed)
    figures: list[Figure] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    choice: dict[str, Any] = field(default_factory=dict)  # estimated against run's own
    verdict: str = ""  # what the run shows
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "available": self.available,
            "held": self.held,
            "figures": [f.to_json() for f in self.figures],
            "runs": self.runs,
            "choice": self.choice,
            "verdict": self.verdict,
            "notes": self.notes,
        }


def drop_model(model: Path) -> None:
    """The model's own pages out of the page cache (a cold start; nothing machine-wide)."""
    for shard in find_shards(model):
        fd = os.open(shard, os.O_RDONLY)
        try:
            drop_cached(fd)
        finally:
            os.close(fd)


def _run(
    model: Path,
    stock: bool,
    memory: int | None,
    threads: tuple[int | None, int | None],
    n_ctx: int,
    n_batch: int,
    prompt: str,
    continuation: str,
    tokens: int,
) -> dict[str, Any]:
    from ..llama.runtime.run import RunOptions, run_model

    opts = RunOptions(
        n_predict=tokens,
        threads=threads[0],
        threads_batch=threads[1],
        n_ctx=n_ctx,
        batch=n_batch,
        memory=memory if memory is not None else "auto",
    )
    if stock:
        opts = replace(opts, prefetch=None)
    drop_model(model)
    r = run_model(model, prompt, opts, continuation=continuation)
    d, p = r.decode.to_json(), r.prefill.to_json()
    streaming = r.streaming or {}
    pager = (r.stream or {}).get("pager") or {}
    tuning = r.thread_tuning or {}
    return {
        "runner": "stock" if stock else "run",
        "engine": streaming.get("engine"),
        "threads": r.threads,
        "threads_chosen": tuning.get("chosen", r.threads),
        "threads_batch": r.threads_batch,
        "budget_bytes": pager.get("budget_bytes")
        or (r.prefetch.memory if r.prefetch and isinstance(r.prefetch.memory, int) else None),
        "memory_total": (streaming.get("memory") or {}).get("total"),
        "placement": (r.weights or {}).get("placement"),
        "decode_tps": d["tokens_per_second"],
        "decode_tokens": d["tokens"],
        "prefill_tps": p["tokens_per_second"],
        "prefill_tokens": p["tokens"],
        "decode_read_per_token": d["bytes_read_per_token"],
        "pager_read_per_token": d["pager_read_bytes_per_token"],
        "decode_faults_per_token": d["major_faults_per_token"],
        "expert_hit_rate": d["expert_hit_rate"],
        "cache_hit_rate": d["cache_hit_rate"],
        "thread_tuning": r.thread_tuning,
    }


def _compare_choice(point: MemoryPoint, run: dict[str, Any]) -> dict[str, Any]:
    """What fit said run would choose against what it chose."""
    ch = point.choice
    est_threads = point.run.threads
    budget = run.get("budget_bytes")
    same_budget = (
        ch.budget == 0
        if not budget
        else ch.budget > 0 and abs(budget / ch.budget - 1) <= BUDGET_TOLERANCE
    )
    out: dict[str, Any] = {
        "engine": {"estimated": ch.engine, "run": run["engine"]},
        "threads_chosen": {"estimated": list(est_threads), "run": run["threads_chosen"]},
        "threads_batch": {"estimated": ch.threads_batch, "run": run["threads_batch"]},
        "budget_bytes": {"estimated": ch.budget, "run": budget},
        "memory_total": {"estimated": ch.plan.total, "run": run.get("memory_total")},
    }
    out["same"] = bool(
        ch.engine == run["engine"]
        and run["threads_chosen"] in est_threads
        and ch.threads_batch == run["threads_batch"]
        and same_budget
    )
    return out


def verify_point(
    model: Path,
    point: MemoryPoint,
    *,
    memory: int | None = None,
    available: int | None = None,
    threads: int | None = None,
    threads_batch: int | None = None,
    n_ctx: int = 4096,
    n_batch: int = 512,
    prompt_tokens: int = 128,
    tokens: int = 16,
    stock: bool = False,
    on_note: Callable[[str], None] | None = None,
    prompt: str | None = None,
    continuation: str | None = None,
) -> FitVerification:
    """Run ``model`` as ``run`` would with ``memory`` / ``threads`` / ``threads_batch`` /
    ``n_ctx`` / ``n_batch`` (and, with ``stock``, ``--no-prefetch`` too), under a holder
    leaving ``available`` when given, and set the estimate's figures beside the runs'. The runs read ``prompt`` (default: about
    ``prompt_tokens`` tokens of filler) and decode ``continuation`` token by token."""
    prompt = prompt if prompt is not None else filler_text(prompt_tokens)
    continuation = continuation if continuation is not None else filler_text(tokens + 1)
    note = on_note or (lambda _m: None)
    avail = mem_available()
    out = FitVerification(avail, 0)
    if point.choice.refusal is not None:  # run would stop before loading: nothing to measure
        out.verdict = "refused"
        out.notes.append(f"run refuses before loading: {point.choice.refusal}")
        return out
    hold = None
    if available is not None:
        leave = available
        least = 2 * MIN_FLOOR
        if leave < least:
            out.notes.append(
                f"cannot leave less than {least >> 20} MiB: ran with {least >> 20} MiB"
            )
            leave = least
        # the holder lets go when the machine comes within a quarter of the memory asked of
        # running out (a fixed 1 GiB floor let go of every run at ~1.2 GiB)
        floor = max(MIN_FLOOR, min(FLOOR, leave // 4))
        if avail > leave + SLACK:
            hold = MemoryHold(leave, floor)
        else:
            out.notes.append(
                f"{avail / 2**30:.1f} GiB available, not more than asked: no memory held"
            )
    with hold if hold is not None else _Nothing():
        if hold is not None:
            out.held, out.available = hold.held, hold.available
            note(f"holding {hold.held / 2**30:.1f} GiB, {hold.available / 2**30:.2f} GiB left")
        for is_stock in (False, True) if stock else (False,):
            note(f"running {'llama.cpp --no-prefetch' if is_stock else 'run'} ...")
            out.runs.append(
                _run(
                    model,
                    is_stock,
                    memory,
                    (threads, threads_batch),
                    n_ctx,
                    n_batch,
                    prompt,
                    continuation,
                    tokens,
                )
            )
        if hold is not None and not hold.alive():
            out.notes.append(
                "the memory holder let go during the runs (the machine ran short): the "
                "measurements are not at the memory asked for"
            )
    run = out.runs[0]
    out.figures.append(Figure("run decode", point.run.run_decode_tps, run["decode_tps"]))
    out.figures.append(Figure("run prefill", point.run.prefill_tps, run["prefill_tps"]))
    if stock:
        s = out.runs[1]
        out.figures.append(Figure("stock decode", point.stock.run_decode_tps, s["decode_tps"]))
        out.figures.append(Figure("stock prefill", point.stock.prefill_tps, s["prefill_tps"]))
    out.choice = _compare_choice(point, run)
    if not out.choice["same"]:
        out.notes.append(
            "run chose otherwise than estimated (see `choice`): the memory available moved "
            "between the estimate and the run"
        )
    if run["engine"] == "llama.cpp":
        out.verdict = "fits"
    else:
        out.verdict = "streams" if run["decode_tps"] >= SLOW_TPS else "too slow"
    return out


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
