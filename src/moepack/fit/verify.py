"""``fit --verify``: run the model, stock and with ``--prefetch``, at the memory the estimate
was for, and set what was measured beside what was estimated.

The memory is made scarce the way the benchmarks make it (``moepack.memhold``: a child
holds the rest of RAM, anonymous and touched, and lets go at once if the machine runs short);
every run is a fresh llama.cpp process feeding the same prompt and continuation, from the
state the estimate is for: a model that fits starts with its file read once (as every run
after the first finds it); one that does not starts cold (its own pages dropped, nothing
machine-wide) and streams.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checkpoint.model import find_shards
from ..memhold import FLOOR, MIN_FLOOR, MemoryHold
from ..pages import drop_cached
from ..storage.linux import mem_available
from .calibrate import filler_text
from .estimate import Estimate, MemoryPoint

SLACK = 512 << 20  # below this much more than asked, holding is not worth it


@dataclass(frozen=True)
class Figure:
    name: str  # "stock decode", ...
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
    memory: int
    held: int  # bytes the holder held (0: none needed)
    available: int  # what was left while the runs ran
    figures: list[Figure] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "memory": self.memory,
            "held": self.held,
            "available": self.available,
            "figures": [f.to_json() for f in self.figures],
            "runs": self.runs,
            "notes": self.notes,
        }


def _drop(model: Path) -> None:
    for shard in find_shards(model):
        fd = os.open(shard, os.O_RDONLY)
        try:
            drop_cached(fd)
        finally:
            os.close(fd)


def _warm(model: Path) -> None:
    """Read every shard through once, so a model that fits starts as it runs every time
    after the first (the estimate's steady state), not from storage."""
    buf = bytearray(16 << 20)
    for shard in find_shards(model):
        with open(shard, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def _run(
    model: Path, est: Estimate, prompt: str, continuation: str, tokens: int, fits: bool
) -> dict[str, Any]:
    from ..llama.prefetcher.streamer import StreamOptions
    from ..llama.runtime.run import RunOptions, run_model

    prefetch = StreamOptions() if est.runner == "prefetch" else None
    opts = RunOptions(
        n_predict=tokens, threads=est.threads, n_ctx=4096, batch=512, prefetch=prefetch
    )
    if fits:
        _warm(model)
    else:
        _drop(model)
    r = run_model(model, prompt, opts, continuation=continuation)
    d, p = r.decode.to_json(), r.prefill.to_json()
    return {
        "runner": est.runner,
        "threads": est.threads,
        "decode_tps": d["tokens_per_second"],
        "prefill_tps": p["tokens_per_second"],
        "prefill_tokens": p["tokens"],
        "decode_read_per_token": d["bytes_read_per_token"],
        "decode_faults_per_token": d["major_faults_per_token"],
        "expert_hit_rate": d["expert_hit_rate"],
    }


def verify_point(
    model: Path,
    point: MemoryPoint,
    prompt_tokens: int,
    tokens: int = 16,
    on_note: Callable[[str], None] | None = None,
    prompt: str | None = None,
    continuation: str | None = None,
) -> FitVerification:
    """Both runners at ``point.memory``; the estimate's figures against the runs'. The runs
    read ``prompt`` (default: about ``prompt_tokens`` tokens of filler) and decode
    ``continuation`` token by token (default: filler), so both runners route alike."""
    prompt = prompt if prompt is not None else filler_text(prompt_tokens)
    continuation = continuation if continuation is not None else filler_text(tokens + 1)
    note = on_note or (lambda _m: None)
    avail = mem_available()
    leave = point.memory
    out = FitVerification(point.memory, 0, avail)
    least = 2 * MIN_FLOOR
    if leave < least:
        out.notes.append(f"cannot leave less than {least >> 20} MiB: ran with {least >> 20} MiB")
        leave = least
    # the holder lets go when the machine comes within a quarter of the memory asked of
    # running out (a fixed 1 GiB floor let go of every run at ~1.2 GiB: the live cache locks
    # most of what is left)
    floor = max(MIN_FLOOR, min(FLOOR, leave // 4))
    hold = MemoryHold(leave, floor) if avail > leave + SLACK else None
    if hold is None:
        out.notes.append(f"{avail / 2**30:.1f} GiB available, not more than asked: no memory held")
    with hold if hold is not None else _Nothing():
        if hold is not None:
            out.held, out.available = hold.held, hold.available
            note(f"holding {hold.held / 2**30:.1f} GiB, {hold.available / 2**30:.2f} GiB left")
        for est in (point.stock, point.prefetch):
            note(f"running {est.runner} with {est.threads} thread(s) ...")
            out.runs.append(_run(model, est, prompt, continuation, tokens, point.fits))
        if hold is not None and not hold.alive():
            out.notes.append(
                "the memory holder let go during the runs (the machine ran short): the "
                "measurements are not at the memory asked for"
            )
    for est, run in zip((point.stock, point.prefetch), out.runs, strict=True):
        out.figures.append(Figure(f"{est.runner} decode", est.decode_tps, run["decode_tps"]))
        out.figures.append(Figure(f"{est.runner} prefill", est.prefill_tps, run["prefill_tps"]))
    return out


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
