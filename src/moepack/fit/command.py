"""``fit_model``: what ``moepack fit`` computes, from a local model or a URL to one.

It reads the model's index (locally, or over HTTP Range into a sparse mirror), asks run's own
code what ``run`` and ``serve`` would choose here (``runchoice``: the engine, the memory plan,
the budget, the threads), finds the device's storage profile and the calibration for the
model's shapes (each measured once and cached), the hit rates (a trace, or the priors), and
asks the cost model what that run will do, at the memory given and two others, and where the
knee is; ``verify`` runs it to check.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cachedir import cache_dir
from ..checkpoint.model import MoeModel
from ..errors import BadInput
from ..llama.runtime.run import cores as usable_cores
from ..progress import NULL_PROGRESS, ProgressSink
from ..storage.linux import mem_available
from .calibrate import Calibration, calibration
from .device import StorageProfile, storage_profile
from .estimate import DECODE_TOKENS, CostModel, MemoryPoint, knee, other_sizes
from .hitrate import RECENCY_SOURCE, HitModel, bound_trace
from .overlap import Overlap, overlap_factors
from .remote import RemoteIndex, fetch_index, is_url
from .runchoice import RunChooser
from .shapes import ModelShape, model_shape
from .verify import FitVerification, verify_point

PROMPT_TOKENS = 128
N_CTX = 4096
N_BATCH = 512  # run's and serve's --batch


@dataclass
class FitResult:
    model: str
    remote: RemoteIndex | None
    shape: ModelShape
    available: int  # the memory available the choice was made in
    available_source: str  # "given" or "available now"
    memory: int | None  # --memory as run would be given it (None: run's auto)
    n_ctx: int
    n_batch: int
    cores: int
    storage: StorageProfile
    calibration: Calibration
    overlap: Overlap
    hit_source: str
    points: list[MemoryPoint]  # the memory asked about first, then two others
    knee: dict[str, Any]
    fit_memory: int  # the least --memory the model and its context fit in
    min_memory: int  # the least --memory the pager runs in
    prompt_tokens: int
    verify: FitVerification | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def main(self) -> MemoryPoint:
        return self.points[0]

    def run_json(self) -> dict[str, Any]:
        """What run will choose, with the decode threads its tuner is expected to settle on."""
        main = self.main
        lo, hi = main.run.threads
        out = main.choice.to_json()
        out["decode_threads_chosen"] = lo if lo == hi else [lo, hi]
        out["summary"] = main.choice.describe(lo if lo == hi else None)
        return out

    def to_json(self) -> dict[str, Any]:
        st = self.storage
        main = self.main
        return {
            "model": self.model,
            "remote": self.remote.to_json() if self.remote else None,
            "shape": self.shape.to_json(),
            "machine": {
                "available": self.available,
                "available_source": self.available_source,
                "cores": self.cores,
            },
            "memory_asked": self.memory,
            "n_ctx": self.n_ctx,
            "batch": self.n_batch,
            "run": self.run_json(),
            "serve": main.served.to_json(),
            "storage": {
                "device": st.device,
                "measured": st.measured,
                "cached": st.cached,
                "read_ahead_kb": st.read_ahead_kb,
                "faults": [
                    {"slice_bytes": c.slice_bytes, "seconds": c.seconds, "bytes_read": c.bytes_read}
                    for c in st.faults
                ],
                "surface": st.surface.to_json(),
                "direct": st.direct.to_json() if st.direct is not None else None,
            },
            "calibration": self.calibration.to_json(),
            "overlap": self.overlap.to_json(),
            "hit_source": self.hit_source,
            "hit_prior_source": None if self.hit_source == "trace" else RECENCY_SOURCE,
            "fits": main.fits,
            "verdict": main.verdict,
            "refusal": main.choice.refusal,
            "fit_memory": self.fit_memory,
            "min_memory": self.min_memory,
            "prompt_tokens": self.prompt_tokens,
            "points": [p.to_json() for p in self.points],
            "knee": self.knee,
            "verify": self.verify.to_json() if self.verify else None,
            "notes": self.notes,
        }


def _open(
    target: str, folder: Path, timeout: float, note: Callable[[str], None]
) -> tuple[MoeModel, RemoteIndex | None]:
    if not is_url(target):
        return MoeModel(target), None
    index = fetch_index(target, folder, timeout=timeout, on_note=note)
    note(
        f"read {index.bytes_read:,} bytes of {index.total_bytes:,} "
        f"({100 * index.share_read:.3f} %) in {index.requests} request(s), "
        f"{len(index.shards)} shard(s)"
    )
    local = {s.local: s.url for s in index.shards}
    try:
        return MoeModel(index.local), index
    except BadInput as e:
        where = local.get(Path(e.path)) if e.path else None
        raise BadInput(e.message, where or target) from None


def fit_model(
    target: str,
    *,
    memory: int | None = None,
    available: int | None = None,
    threads: int | None = None,
    threads_batch: int | None = None,
    n_ctx: int = N_CTX,
    n_batch: int = N_BATCH,
    trace: Path | None = None,
    probe: bool = False,
    verify: bool = False,
    verify_stock: bool = False,
    prompt_tokens: int = PROMPT_TOKENS,
    timeout: float = 30.0,
    progress: ProgressSink = NULL_PROGRESS,
    on_note: Callable[[str], None] | None = None,
    probe_options: dict[str, Any] | None = None,
    verify_text: tuple[str, str] | None = None,
    verify_tokens: int = DECODE_TOKENS,
) -> FitResult:
    """The estimate for ``target`` (a GGUF, any shard of a split set, or an http(s) URL) run
    as ``run`` runs it with ``--memory memory`` (None: none given), ``--threads threads`` and
    ``--threads-batch threads_batch`` (None: run chooses), ``--ctx n_ctx`` and ``--batch
    n_batch``, and served as ``serve`` serves it with the same flags, on this machine with
    ``available`` bytes available (None: MemAvailable now). ``verify`` runs it (under a holder leaving
    ``available`` when given; ``verify_stock``: llama.cpp's own mmap too), on ``verify_text``
    (prompt, continuation) when given."""
    note = on_note or (lambda _m: None)
    remote = is_url(target)
    if verify and remote:
        raise BadInput("verify runs the model: give a local file, not a URL", target)
    for name, value in (("memory", memory), ("available", available)):
        if value is not None and value <= 0:
            raise BadInput(f"`{name}` must be positive")
    if prompt_tokens < 1:
        raise BadInput("`prompt_tokens` must be at least 1")
    if n_ctx < 8:
        raise BadInput("`n_ctx` must be at least 8 tokens")
    if n_batch < 1 or (threads_batch is not None and threads_batch < 1):
        raise BadInput("`n_batch` and `threads_batch` must be at least 1")
    folder = Path(tempfile.mkdtemp(prefix="moepack-fit-index-"))
    try:
        model, index = _open(target, folder, timeout, note)
        with model:
            shape = model_shape(model)
            trace_obj = bound_trace(trace, model, shape) if trace is not None else None
            hits = HitModel(shape, trace_obj, model)
            path = model.shard_paths[0]
            cores = usable_cores()
            have = available if available is not None else mem_available()
            chooser, server = (
                RunChooser(
                    path,
                    available=have,
                    threads=threads,
                    threads_batch=threads_batch,
                    n_ctx=n_ctx,
                    n_batch=n_batch,
                    serve=serve,
                )
                for serve in (False, True)
            )
            main = chooser.choose(memory)
            served = server.choose(memory)
            counts = {1, main.threads, main.threads_batch, *(main.tune or ()), cores}
            counts |= {served.threads, served.threads_batch}
            probed = path if not remote else cache_dir() / "fit" / "probe"
            if remote:
                probed.mkdir(parents=True, exist_ok=True)
            storage = storage_profile(
                probed, probe=probe, progress=progress, **(probe_options or {})
            )
            cal = calibration(shape, sorted(counts), prompt_tokens, progress)
            overlap = overlap_factors(cal.cpu)
            cost = CostModel(
                shape,
                cal,
                storage,
                hits,
                overlap,
                cores,
                prompt_tokens=prompt_tokens,
                decode_tokens=verify_tokens,
                ubatch=n_batch,
            )
            counted = chooser.counted()
            fit_memory = shape.file_bytes + counted.reserve
            min_memory = min(fit_memory, counted.dense + counted.reserve + main.least)
            sizes = other_sizes(main.plan.total, min_memory, fit_memory)
            points = [
                cost.point(main, served),
                *(cost.point(chooser.at(m), server.at(m)) for m in sizes),
            ]
            best = cost.best_tps(main)
            knee_at = knee(cost, chooser.at, min_memory, fit_memory, best)
            notes = list(cal.notes)
            if trace_obj is not None:
                notes.append(f"hit rates from {trace} ({trace_obj.tokens} tokens), bound by shape")
            if remote:
                notes.append(
                    "storage measured where moepack caches (the download's device may differ)"
                )
            if storage.direct is None:
                notes.append(
                    "the filesystem refuses O_DIRECT here: the pager reads buffered, and so "
                    "does the estimate"
                )
            result = FitResult(
                model=target,
                remote=index,
                shape=shape,
                available=have,
                available_source="given" if available is not None else "available now",
                memory=memory,
                n_ctx=n_ctx,
                n_batch=n_batch,
                cores=cores,
                storage=storage,
                calibration=cal,
                overlap=overlap,
                hit_source=hits.source,
                points=points,
                knee=knee_at,
                fit_memory=fit_memory,
                min_memory=min_memory,
                prompt_tokens=prompt_tokens,
                notes=notes,
            )
        if verify:
            prompt, continuation = verify_text or (None, None)
            result.verify = verify_point(
                Path(target),
                points[0],
                memory=memory,
                available=available,
                threads=threads,
                threads_batch=threads_batch,
                n_ctx=n_ctx,
                n_batch=n_batch,
                prompt_tokens=prompt_tokens,
                tokens=verify_tokens,
                stock=verify_stock,
                on_note=note,
                prompt=prompt,
                continuation=continuation,
            )
        return result
    finally:
        shutil.rmtree(folder, ignore_errors=True)
