"""``fit_model``: what ``moepack fit`` computes, from a local model or a URL to one.

It reads the model's index (locally, or over HTTP Range), finds the machine's memory and
cores, the device's storage profile and the calibration for the model's shapes (each
measured once and cached), the hit rates (a trace, or the priors), and asks the cost model
for the memory given, two others and the knee; ``verify`` runs the model to check.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cachedir import cache_dir
from ..checkpoint.model import MoeModel
from ..errors import BadInput
from ..progress import NULL_PROGRESS, ProgressSink
from ..storage.linux import mem_available
from .calibrate import Calibration, calibration
from .device import StorageProfile, storage_profile
from .estimate import CostModel, MemoryPoint, other_sizes
from .hitrate import RECENCY_SOURCE, HitModel, bound_trace
from .remote import RemoteIndex, fetch_index, is_url
from .shapes import ModelShape, model_shape
from .verify import FitVerification, verify_point

PROMPT_TOKENS = 128


@dataclass
class FitResult:
    model: str
    remote: RemoteIndex | None
    shape: ModelShape
    memory: int
    memory_source: str  # "given" or "available now"
    cores: int
    threads: list[int]
    storage: StorageProfile
    calibration: Calibration
    hit_source: str
    points: list[MemoryPoint]  # the memory asked about first, then two others
    knee: dict[str, Any]
    fit_memory: int
    min_memory: int
    prompt_tokens: int
    verify: FitVerification | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def main(self) -> MemoryPoint:
        return self.points[0]

    def to_json(self) -> dict[str, Any]:
        st = self.storage
        return {
            "model": self.model,
            "remote": self.remote.to_json() if self.remote else None,
            "shape": self.shape.to_json(),
            "machine": {
                "memory": self.memory,
                "memory_source": self.memory_source,
                "cores": self.cores,
                "threads_considered": self.threads,
            },
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
            },
            "calibration": self.calibration.to_json(),
            "hit_source": self.hit_source,
            "hit_prior_source": None if self.hit_source == "trace" else RECENCY_SOURCE,
            "fits": self.main.fits,
            "verdict": self.main.verdict,
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
    threads: int | None = None,
    trace: Path | None = None,
    probe: bool = False,
    verify: bool = False,
    prompt_tokens: int = PROMPT_TOKENS,
    timeout: float = 30.0,
    progress: ProgressSink = NULL_PROGRESS,
    on_note: Callable[[str], None] | None = None,
    probe_options: dict[str, Any] | None = None,
    verify_text: tuple[str, str] | None = None,
    verify_tokens: int = 16,
) -> FitResult:
    """The estimate for ``target`` (a GGUF, any shard of a split set, or an http(s) URL);
    ``verify`` runs it, on ``verify_text`` (prompt, continuation) when given."""
    note = on_note or (lambda _m: None)
    remote = is_url(target)
    if verify and remote:
        raise BadInput("verify runs the model: give a local file, not a URL", target)
    if memory is not None and memory <= 0:
        raise BadInput("`memory` must be positive")
    if prompt_tokens < 1:
        raise BadInput("`prompt_tokens` must be at least 1")
    folder = Path(tempfile.mkdtemp(prefix="moepack-fit-index-"))
    try:
        model, index = _open(target, folder, timeout, note)
        with model:
            shape = model_shape(model)
            trace_obj = bound_trace(trace, model, shape) if trace is not None else None
            hits = HitModel(shape, trace_obj, model)
            cores = os.cpu_count() or 1
            thread_list = [threads] if threads else sorted({1, cores})
            have = mem_available()
            mem = memory if memory is not None else have
            probed = model.shard_paths[0] if not remote else cache_dir() / "fit" / "probe"
            if remote:
                probed.mkdir(parents=True, exist_ok=True)
            storage = storage_profile(
                probed, probe=probe, progress=progress, **(probe_options or {})
            )
            cal = calibration(shape, thread_list, prompt_tokens, progress)
            cost = CostModel(shape, cal, storage, hits, prompt_tokens=prompt_tokens)
            points = [cost.point(m, thread_list) for m in [mem, *other_sizes(mem, cost)]]
            knee = cost.knee(thread_list)
            notes = list(cal.notes)
            if trace_obj is not None:
                notes.append(f"hit rates from {trace} ({trace_obj.tokens} tokens), bound by shape")
            if remote:
                notes.append(
                    "storage measured where moepack caches (the download's device may differ)"
                )
            result = FitResult(
                model=target,
                remote=index,
                shape=shape,
                memory=mem,
                memory_source="given" if memory is not None else "available now",
                cores=cores,
                threads=thread_list,
                storage=storage,
                calibration=cal,
                hit_source=hits.source,
                points=points,
                knee=knee,
                fit_memory=cost.fit_memory,
                min_memory=cost.min_memory,
                prompt_tokens=prompt_tokens,
                notes=notes,
            )
        if verify:
            prompt, continuation = verify_text or (None, None)
            result.verify = verify_point(
                Path(target), points[0], prompt_tokens, verify_tokens, note, prompt, continuation
            )
        return result
    finally:
        shutil.rmtree(folder, ignore_errors=True)
