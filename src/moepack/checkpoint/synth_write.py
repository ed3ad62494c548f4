"""Writing a planned synthetic model: gguf-py writes the header and tensor index, then worker
threads draw, quantise and write the tensors straight into their planned places.

Each worker takes a whole tensor (its values come from one generator, in order) and works
through it a chunk of rows at a time: draw, quantise (ggml's C quantiser where llama.cpp is
installed, gguf-py's otherwise), ``pwrite`` at the tensor's offset. numpy's generator, ggml
and ``pwrite`` all release the GIL, so the cores share the work, and memory is a chunk per
worker whatever the model's size. Tensors land at offsets fixed in advance, so the file is the
same bytes whatever order the workers finish in.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from ..errors import MoepackError
from ..interrupts import deferred
from ..progress import ProgressSink
from .ggml_c import can_quantise, quantiser_unavailable
from .ggml_c import quantise_rows as ggml_quantise
from .synth_plan import PlannedTensor, SynthPlan, gguf_writer
from .synth_values import value_chunks

if TYPE_CHECKING:
    from .synth import SynthSpec

CHUNK_VALUES = 1 << 20  # values drawn and quantised at a time (4 MiB of F32)
POLL_SECONDS = 0.2  # how often the progress bar moves (and an interrupt is noticed at least)
_GGUF_PY = frozenset(
    {
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
    }
)


def default_threads() -> int:
    """Every core this process may run on (a few at most: past that the disk decides)."""
    return max(1, min(len(os.sched_getaffinity(0)), 8))


def encoder_missing(qtypes: set[GGMLQuantizationType]) -> str | None:
    """Why some of ``qtypes`` cannot be written here (None when all can)."""
    for qtype in qtypes:
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or qtype in _GGUF_PY:
            continue
        if not can_quantise(qtype):
            why = quantiser_unavailable() or f"this ggml cannot quantise {qtype.name}"
            return f"{qtype.name} is quantised by llama.cpp's ggml: {why}"
    return None


def encode(rows: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """F32 rows as the bytes of ``qtype`` (ggml's quantiser first: the same bytes as gguf-py's
    for the types both have, faster, and without the GIL)."""
    if qtype == GGMLQuantizationType.F32:
        return np.ascontiguousarray(rows, dtype=np.float32).view(np.uint8).reshape(-1)
    if qtype == GGMLQuantizationType.F16:
        return rows.astype(np.float16).view(np.uint8).reshape(-1)
    if can_quantise(qtype):
        return ggml_quantise(rows, qtype)
    return np.ascontiguousarray(quantize(rows, qtype)).view(np.uint8).reshape(-1)


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = np.ascontiguousarray(data).data.cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class _Written:
    """Bytes written by the workers since the progress bar last moved."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = 0

    def add(self, n: int) -> None:
        with self._lock:
            self._bytes += n

    def take(self) -> int:
        with self._lock:
            n, self._bytes = self._bytes, 0
        return n


def _write_tensor(
    spec: SynthSpec,
    tensor: PlannedTensor,
    fd: int,
    start: int,
    stop: threading.Event,
    written: Callable[[int], None],
) -> None:
    offset = start + tensor.offset
    for rows in value_chunks(spec, tensor.plan, CHUNK_VALUES):
        if stop.is_set():
            return
        data = encode(rows, tensor.qtype)
        del rows
        _pwrite_all(fd, data, offset)
        offset += data.nbytes
        written(data.nbytes)
    if offset != start + tensor.offset + tensor.nbytes:
        raise MoepackError(
            f"{tensor.plan.name}: wrote {offset - start - tensor.offset:,} bytes, "
            f"planned {tensor.nbytes:,}"
        )


def write_synth(
    spec: SynthSpec,
    plan: SynthPlan,
    path: Path,
    split_max_size: int,
    progress: ProgressSink,
    threads: int,
) -> list[Path]:
    """Write the model ``plan`` lays out to ``path`` (or its shards); return the files."""
    typed = [(t.plan, t.qtype) for t in plan.tensors]
    writer = gguf_writer(spec, path, typed, split_max_size)
    progress.start(f"writing {path.name}", plan.tensor_bytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    try:
        assert writer.fout is not None
        fds = [f.fileno() for f in writer.fout]
        starts = [writer.ggml_pad(f.tell(), writer.data_alignment) for f in writer.fout]
        if starts != plan.header_bytes:
            raise MoepackError(f"gguf-py wrote headers of {starts}, planned {plan.header_bytes}")
        _write_tensors(spec, plan, fds, progress, threads)
        for fd, size in zip(fds, plan.shard_bytes, strict=True):
            os.ftruncate(fd, size)  # the last tensor's padding
    finally:
        writer.close()
    progress.finish()
    return writer.format_shard_names(path)


def _write_tensors(
    spec: SynthSpec, plan: SynthPlan, fds: list[int], progress: ProgressSink, threads: int
) -> None:
    stop = threading.Event()
    written = _Written()
    pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="moepack-synth")
    try:
        pending: set[Future[None]] = {
            pool.submit(
                _write_tensor,
                spec,
                t,
                fds[t.shard],
                plan.header_bytes[t.shard],
                stop,
                written.add,
            )
            for t in plan.tensors
        }
        while pending:
            done, pending = wait(pending, timeout=POLL_SECONDS, return_when=FIRST_EXCEPTION)
            progress.advance(written.take())
            for f in done:
                f.result()  # a worker's error (a full disk) is raised here
    finally:
        # On an error or an interrupt the workers stop at their next chunk; a second signal
        # waits for them too (the files they write to are closed and removed next).
        with deferred():
            stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
    progress.advance(written.take())
