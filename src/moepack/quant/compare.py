"""``compare``: dequantise the same tensors of two GGUFs of one model and measure the difference.

Tensors are read with ``pread`` into bounded buffers, a chunk of whole rows at a time, so a
multi-GB tensor never sits in memory (not even mapped); tensors run in parallel threads (numpy
and ctypes release the GIL). Expert-axis tensors are compared expert by expert, each original
expert against itself: a repacked file's recorded permutation says which slot holds it.
"""

from __future__ import annotations

import fnmatch
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ..checkpoint.gguf_file import TensorEntry
from ..checkpoint.model import ExpertTensor, MoeModel
from ..checkpoint.provenance import read_provenance
from ..errors import BadInput, MoepackError
from ..progress import NULL_PROGRESS, ProgressSink
from ..storage.copy import pread_exact
from .engine import DEQUANT_ENGINES, DequantEngine, engine_for
from .metrics import DiffStats, Metrics
from .pairing import TensorPair, pair_tensors

ABSURD_REL_ERROR = 1.0
"""A relative error above 100 %: the difference outweighs the values; no quantisation is that.
Judged per tensor and per expert slice: honest quantisation of a router's rows reaches at worst
87 % in one row (TQ1_0, ternary), 61 % (IQ1_M, Q1_0), 32 % for every type of 2 bits or more,
while a row holding another expert's values is 141 % off (``bench_router_verdict.py``)."""
SLICES_NAMED = 3
"""Expert slices named in a failure (the JSON lists every slice with ``per_expert``)."""
CHUNK_VALUES = 1 << 20
"""Values dequantised per side and step (4 MiB of float32): what bounds memory per thread."""


@dataclass(frozen=True)
class Thresholds:
    """The verdict: a tensor fails below ``min_correlation``, above ``max_rel_error`` (when
    set) or ``ABSURD_REL_ERROR`` (always: a candidate scaled a thousandfold correlates
    perfectly), when the files disagree about how many values are non-finite, or when one of
    its expert slices (router rows included) is absurdly far from the same expert's."""

    min_correlation: float = 0.99
    max_rel_error: float | None = None

    def failures(self, m: Metrics) -> list[str]:
        out = []
        if m.nonfinite_ref != m.nonfinite_cand:  # the cause of any other failure: first
            out.append(
                f"decodes to non-finite values (NaN or infinity): {m.nonfinite_cand:,} in the "
                f"candidate, {m.nonfinite_ref:,} in the reference"
            )
        if m.correlation is None or m.correlation < self.min_correlation:
            corr = "undefined" if m.correlation is None else f"{m.correlation:.6f}"
            if not m.identical:
                out.append(f"correlation {corr} < {self.min_correlation}")
        if self.max_rel_error is not None and (m.rel_error or 0.0) > self.max_rel_error:
            out.append(f"relative error {m.rel_error:.6f} > {self.max_rel_error}")
        elif (m.rel_error or 0.0) > ABSURD_REL_ERROR:
            out.append(
                f"relative error {m.rel_error:.3g} is absurd (the difference is larger than "
                "the reference itself)"
            )
        return out

    def slice_failures(self, slices: list[tuple[int, Metrics]]) -> list[str]:
        """The expert slices (``(expert, metrics)``) whose relative error is absurd: a slice
        that holds another expert's values (two router rows swapped, an expert moved without a
        recorded permutation) hides in a tensor of hundreds of experts, whose correlation and
        relative error a quantisation of every slice would reach, but not in its own slice."""
        bad = [(e, m) for e, m in slices if (m.rel_error or 0.0) > ABSURD_REL_ERROR]
        if not bad:
            return []
        bad.sort(key=lambda em: -(em[1].rel_error or 0.0))
        named = ", ".join(f"expert {e}: {m.rel_error:.3g}" for e, m in bad[:SLICES_NAMED])
        more = f", {len(bad) - SLICES_NAMED} more" if len(bad) > SLICES_NAMED else ""
        return [
            f"{len(bad)} of {len(slices)} expert slices differ by more than their own values "
            f"(relative error {named}{more}): another expert's values, moved without a "
            "recorded permutation?"
        ]


@dataclass(frozen=True)
class ExpertDiff:
    """One original expert's slice: where it sits in each file, and how far apart."""

    expert: int
    slot_ref: int
    slot_cand: int
    metrics: Metrics


@dataclass(frozen=True)
class TensorDiff:
    name: str
    ref_tensor: str  # differs from ``name`` where the reference is fused
    cand_tensor: str  # differs from ``name`` where the candidate is fused
    block: int | None
    type_ref: str
    type_cand: str
    engine_ref: str
    engine_cand: str
    metrics: Metrics
    failures: list[str]
    experts: list[ExpertDiff] = field(default_factory=list)  # worst first

    @property
    def ok(self) -> bool:
        return not self.failures


@dataclass(frozen=True)
class SkippedTensor:
    name: str
    type_ref: str
    type_cand: str
    reason: str


@dataclass(frozen=True)
class CompareResult:
    ref: Path
    cand: Path
    engine: str
    thresholds: Thresholds
    tensors: list[TensorDiff]
    skipped: list[SkippedTensor]
    bytes_read: int
    seconds: float

    @property
    def ok(self) -> bool:
        return all(t.ok for t in self.tensors)

    @property
    def worst(self) -> TensorDiff | None:
        return min(self.tensors, key=lambda t: t.metrics.badness(), default=None)

    def to_json(self) -> dict[str, object]:
        from ..jsonable import to_jsonable

        out = {f.name: to_jsonable(getattr(self, f.name)) for f in fields(self)}
        out["tensors"] = [{**to_jsonable(t), "ok": t.ok} for t in self.tensors]
        out["ok"] = self.ok
        return out


@dataclass(frozen=True)
class _Segment:
    """A run of values to compare: a whole tensor, or one expert's slice in each file."""

    expert: int | None
    slot_ref: int
    slot_cand: int
    off_ref: int
    off_cand: int
    values: int


@dataclass(frozen=True)
class _Job:
    pair: TensorPair
    block: int | None
    ref: TensorEntry
    cand: TensorEntry
    fd_ref: int
    fd_cand: int
    engine_ref: DequantEngine
    engine_cand: DequantEngine
    segments: list[_Segment]


def _n_values(entry: TensorEntry) -> int:
    return math.prod(entry.ne)


def _bytes_for(qtype: GGMLQuantizationType, values: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return values // block * size


def _slots(model: MoeModel, block: int, n_expert: int) -> np.ndarray:
    """``slot[original expert]`` in ``model`` (identity for a file never repacked)."""
    prov = read_provenance(model)
    perm = prov.perm(block, n_expert) if prov is not None else np.arange(n_expert)
    slots = np.empty(n_expert, dtype=np.int64)
    slots[perm] = np.arange(n_expert)
    return slots


def _expert_axis(ref: MoeModel, cand: MoeModel, pair: TensorPair) -> ExpertTensor | None:
    for model, name in ((ref, pair.ref_name), (cand, pair.cand_name)):
        for block in model.blocks:
            for t in block.tensors:
                if t.name == name:
                    return t
    return None


def _segments(
    ref: MoeModel, cand: MoeModel, pair: TensorPair, xt: ExpertTensor | None
) -> list[_Segment]:
    """Whole tensors, or one segment per original expert (``xt``, the pair's expert-axis
    tensor): its slot in each file from the recorded permutations, the gate or up half of a
    fused slice."""
    a, b = ref.tensors[pair.ref_name], cand.tensors[pair.cand_name]
    values = _n_values(a) // (2 if pair.ref_half is not None else 1)
    if xt is None:
        return [_Segment(None, 0, 0, a.offset, b.offset, values)]
    n = xt.n_expert
    sa, sb = _slots(ref, xt.block, n), _slots(cand, xt.block, n)
    step_a, step_b = a.n_bytes // n, b.n_bytes // n
    half_a = (pair.ref_half or 0) * step_a // 2
    half_b = (pair.cand_half or 0) * step_b // 2
    return [
        _Segment(
            e,
            int(sa[e]),
            int(sb[e]),
            a.offset + int(sa[e]) * step_a + half_a,
            b.offset + int(sb[e]) * step_b + half_b,
            values // n,
        )
        for e in range(n)
    ]


class _Reader:
    """One thread's two reusable read buffers."""

    def __init__(self) -> None:
        self.bufs = [bytearray(), bytearray()]

    def read(self, side: int, fd: int, offset: int, n: int) -> np.ndarray:
        buf = self.bufs[side]
        if len(buf) < n:
            buf.extend(bytes(n - len(buf)))
        view = memoryview(buf)[:n]
        pread_exact(fd, view, offset)
        return np.frombuffer(view, dtype=np.uint8)


class _Stopped(Exception):
    """The run was abandoned (an interrupt or another tensor's error): workers stop early."""


def _run_job(
    job: _Job, chunk_values: int, advance: ProgressSink, stop: threading.Event
) -> list[tuple[_Segment, DiffStats]]:
    ta, tb = job.ref.ggml_type, job.cand.ggml_type
    unit = math.lcm(GGML_QUANT_SIZES[ta][0], GGML_QUANT_SIZES[tb][0])
    step = max(unit, chunk_values // unit * unit)
    reader = _Reader()
    out = []
    for seg in job.segments:
        stats = DiffStats()
        done = 0
        while done < seg.values:
            if stop.is_set():
                raise _Stopped
            n = min(step, seg.values - done)
            na, nb = _bytes_for(ta, n), _bytes_for(tb, n)
            raw_a = reader.read(0, job.fd_ref, seg.off_ref + _bytes_for(ta, done), na)
            va = job.engine_ref.dequantize(raw_a, ta)
            raw_b = reader.read(1, job.fd_cand, seg.off_cand + _bytes_for(tb, done), nb)
            vb = job.engine_cand.dequantize(raw_b, tb)
            stats.add(va, vb)
            advance.advance(na + nb)
            done += n
        out.append((seg, stats))
    return out


class _LockedProgress:
    """Worker threads advance one bar."""

    def __init__(self, sink: ProgressSink) -> None:
        self.sink = sink
        self.lock = threading.Lock()

    def start(self, description: str, total: int, unit: str = "B") -> None:
        self.sink.start(description, total, unit)

    def advance(self, amount: int) -> None:
        with self.lock:
            self.sink.advance(amount)

    def finish(self) -> None:
        self.sink.finish()


def _open_all(model: MoeModel) -> list[int]:
    fds: list[int] = []
    try:
        for p in model.shard_paths:
            fds.append(os.open(p, os.O_RDONLY))
    except OSError as e:
        for fd in fds:
            os.close(fd)
        raise BadInput(f"cannot read: {e.strerror}", e.filename) from None
    return fds


def compare(
    ref_path: str | os.PathLike[str],
    cand_path: str | os.PathLike[str],
    *,
    tensor_pattern: str | None = None,
    per_expert: bool = False,
    limit: int | None = None,
    engine: str = "gguf",
    thresholds: Thresholds = Thresholds(),
    chunk_values: int = CHUNK_VALUES,
    workers: int | None = None,
    progress: ProgressSink = NULL_PROGRESS,
) -> CompareResult:
    """Dequantise the tensors both files hold (matching ``tensor_pattern``, a glob; at most
    ``limit`` of them) and measure candidate against reference."""
    preferred = DEQUANT_ENGINES.get(engine)
    why = preferred.unavailable_reason()
    if why is not None:
        raise MoepackError(f"engine {preferred.name!r} cannot run: {why}")
    if limit is not None and limit < 1:
        raise BadInput(f"`limit` must be at least 1, not {limit}")
    if chunk_values < 1:
        raise BadInput(f"chunk must hold at least one value, not {chunk_values}")
    t0 = time.perf_counter()
    with MoeModel(ref_path) as ref, MoeModel(cand_path) as cand:
        pairs = pair_tensors(ref, cand)
        if tensor_pattern is not None:
            pairs = [p for p in pairs if _matches(p, tensor_pattern)]
            if not pairs:
                raise BadInput(f"no tensor matches {tensor_pattern!r}", ref.path)
        if limit is not None:
            pairs = pairs[:limit]
        fds_ref, fds_cand = _open_all(ref), _open_all(cand)
        try:
            jobs, skipped = _plan_jobs(ref, cand, pairs, preferred, fds_ref, fds_cand)
            results = _run_all(jobs, chunk_values, workers, progress)
        finally:
            for fd in fds_ref + fds_cand:
                os.close(fd)
        tensors = [_summarise(job, segs, per_expert, thresholds) for job, segs in results]
        return CompareResult(
            ref=Path(ref_path),
            cand=Path(cand_path),
            engine=preferred.name,
            thresholds=thresholds,
            tensors=tensors,
            skipped=skipped,
            bytes_read=sum(_job_bytes(j) for j in jobs),
            seconds=time.perf_counter() - t0,
        )


def _matches(pair: TensorPair, pattern: str) -> bool:
    names = {pair.name, pair.ref_name, pair.cand_name}
    return any(fnmatch.fnmatchcase(n, pattern) for n in names)


def _plan_jobs(
    ref: MoeModel,
    cand: MoeModel,
    pairs: list[TensorPair],
    preferred: DequantEngine,
    fds_ref: list[int],
    fds_cand: list[int],
) -> tuple[list[_Job], list[SkippedTensor]]:
    jobs, skipped = [], []
    for pair in pairs:
        a, b = ref.tensors[pair.ref_name], cand.tensors[pair.cand_name]
        ea, eb = engine_for(a.ggml_type, preferred), engine_for(b.ggml_type, preferred)
        if ea is None or eb is None:
            unknown = a.type_name if ea is None else b.type_name
            skipped.append(
                SkippedTensor(
                    pair.name, a.type_name, b.type_name, f"no engine dequantises {unknown}"
                )
            )
            continue
        xt = _expert_axis(ref, cand, pair)
        jobs.append(
            _Job(
                pair,
                xt.block if xt is not None else None,
                a,
                b,
                fds_ref[ref.tensor_shard[pair.ref_name]],
                fds_cand[cand.tensor_shard[pair.cand_name]],
                ea,
                eb,
                _segments(ref, cand, pair, xt),
            )
        )
    return jobs, skipped


def _job_bytes(job: _Job) -> int:
    values = sum(s.values for s in job.segments)
    return _bytes_for(job.ref.ggml_type, values) + _bytes_for(job.cand.ggml_type, values)


def _run_all(
    jobs: list[_Job], chunk_values: int, workers: int | None, progress: ProgressSink
) -> list[tuple[_Job, list[tuple[_Segment, DiffStats]]]]:
    sink = _LockedProgress(progress)
    sink.start("comparing", sum(_job_bytes(j) for j in jobs))
    n = workers or min(4, os.cpu_count() or 1)
    stop = threading.Event()
    try:
        if n <= 1 or len(jobs) <= 1:
            return [(j, _run_job(j, chunk_values, sink, stop)) for j in jobs]
        pool = ThreadPoolExecutor(max_workers=n)
        try:
            futures = [pool.submit(_run_job, j, chunk_values, sink, stop) for j in jobs]
            return [(j, f.result()) for j, f in zip(jobs, futures, strict=True)]
        except BaseException:
            stop.set()  # an interrupt or a failure: workers stop within one chunk
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    finally:
        sink.finish()


def _summarise(
    job: _Job,
    segs: list[tuple[_Segment, DiffStats]],
    per_expert: bool,
    thresholds: Thresholds,
) -> TensorDiff:
    total = DiffStats()
    for _seg, stats in segs:
        total.merge(stats)
    metrics = total.metrics()
    slices = [
        ExpertDiff(s.expert, s.slot_ref, s.slot_cand, st.metrics())
        for s, st in segs
        if s.expert is not None
    ]
    failures = thresholds.failures(metrics)
    failures += thresholds.slice_failures([(x.expert, x.metrics) for x in slices])
    experts: list[ExpertDiff] = []
    if per_expert and job.block is not None:
        experts = sorted(slices, key=lambda x: x.metrics.badness())
    return TensorDiff(
        name=job.pair.name,
        ref_tensor=job.pair.ref_name,
        cand_tensor=job.pair.cand_name,
        block=job.block,
        type_ref=job.ref.type_name,
        type_cand=job.cand.type_name,
        engine_ref=job.engine_ref.name,
        engine_cand=job.engine_cand.name,
        metrics=metrics,
        failures=failures,
        experts=experts,
    )
