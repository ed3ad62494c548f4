"""``build_store``: write a model's routed experts as an expert-major store.

Each record's parts are copied from the GGUF through the kernel (``storage.copy``: no user-space
buffer, flat RSS), or, for an expert a precision plan requantises, written from one bounded
requantisation at a time. Each block's records are then read back through one reusable buffer
and their sha256 recorded, so the checksums are of the bytes on disk. The index and the header
go last; the file appears atomically (``safeio``) or not at all. Dense tensors, routers and
shared experts stay in the GGUF: the store holds only what routing selects.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from gguf.constants import GGMLQuantizationType

from .. import __version__
from ..binding import basis, shape_only_warning
from ..checkpoint.model import MoeModel
from ..errors import BadInput
from ..filekinds import STORE, check_output_kind
from ..layout.plan import Plan
from ..progress import NULL_PROGRESS, ProgressSink
from ..quant.metrics import Metrics
from ..safeio import AtomicOutputs, check_destination, check_free_space, describe_os_error
from ..storage.copy import CHUNK, RangeCopier, copy_ranges, pread_exact, pwrite_all
from ..storage.writeback import Writeback
from .format import Header, check_alignment
from .index import BlockIndex, StoredExpert, StoreIndex
from .placement import PlacedBlock, StorePlacement, place_store
from .requantiser import Requantiser

DEFAULT_ALIGNMENT = 4096


@dataclass
class BuildResult:
    """What ``build_store`` wrote."""

    out: Path
    fingerprint: str
    layout: str
    alignment: int
    blocks: list[int]
    experts: int
    payload_bytes: int  # the parts' bytes
    store_bytes: int  # the whole file
    estimated_bytes: int  # what the free-space check asked for (exact without a precision plan)
    source_expert_bytes: int  # the same experts' bytes in the GGUF
    seconds: float
    plan_binding: str | None = None  # how the plan was tied to the model, when one was given
    precision: dict[str, Any] | None = None  # the requantisation's summary, when one ran
    warnings: list[str] = field(default_factory=list)

    @property
    def padding_bytes(self) -> int:
        return self.store_bytes - self.payload_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "fingerprint": self.fingerprint,
            "layout": self.layout,
            "alignment": self.alignment,
            "blocks": self.blocks,
            "experts": self.experts,
            "payload_bytes": self.payload_bytes,
            "store_bytes": self.store_bytes,
            "estimated_bytes": self.estimated_bytes,
            "padding_bytes": self.padding_bytes,
            "source_expert_bytes": self.source_expert_bytes,
            "seconds": self.seconds,
            "plan_binding": self.plan_binding,
            "precision": self.precision,
            "warnings": self.warnings,
        }


def build_store(
    model_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    plan: Plan | None = None,
    plan_path: str | os.PathLike[str] | None = None,
    requantiser: Requantiser | None = None,
    alignment: int = DEFAULT_ALIGNMENT,
    progress: ProgressSink = NULL_PROGRESS,
    assume_expert: tuple[str, ...] = (),
    assume_not_expert: tuple[str, ...] = (),
) -> BuildResult:
    """Write the expert-major store of ``model_path`` to ``out`` (see the module docstring).

    ``plan`` orders each block's experts (slot order); ``requantiser`` (from a precision plan)
    stores chosen experts at their own types; ``assume_expert`` / ``assume_not_expert`` settle
    tensors the detector reports as ambiguous (a block with one is refused otherwise)."""
    t0 = time.perf_counter()
    why = check_alignment(alignment)
    if why is not None:
        raise BadInput(why)
    with MoeModel(model_path, assume_expert, assume_not_expert) as model:
        warnings: list[str] = []
        if plan is not None:
            plan.check_against(model, plan_path)
            if plan.model_fingerprint is None:
                warnings.append(shape_only_warning("plan", plan_path, model.path))
        if requantiser is not None:
            requantiser.check_against(model)
        placement = place_store(
            model, plan, alignment, requantiser.stored_type if requantiser else None
        )
        inputs = list(model.shard_paths) + ([Path(plan_path)] if plan_path else [])
        if requantiser is not None and requantiser.path is not None:
            inputs.append(requantiser.path)
        dest = check_destination(check_output_kind(out, STORE), inputs)

        def index_of(blocks: tuple[BlockIndex, ...], precision: Any) -> StoreIndex:
            return StoreIndex(
                fingerprint=model.fingerprint,
                model=model.path.name,
                architecture=model.architecture,
                alignment=alignment,
                layout=placement.layout,
                blocks=blocks,
                plan=_plan_record(plan, plan_path),
                precision=precision,
                created_by=f"moepack {__version__}",
            )

        needed = estimated_store_bytes(placement, index_of, requantiser)
        check_free_space(dest.parent, needed, "the expert store")
        payload = sum(p.size for b in placement.blocks for r in b.records for p in r.parts)
        progress.start(f"building {dest.name}", 2 * payload)
        try:
            with AtomicOutputs(inputs) as outs:
                fd = outs.open(dest).fileno()
                blocks = _write_records(model, placement, fd, requantiser, progress)
                precision = requantiser.summary() if requantiser else None
                index = index_of(blocks, precision)
                store_bytes = _write_index(fd, placement, index)
        except OSError as e:
            raise describe_os_error(e, dest) from None
        finally:
            progress.finish()
            if requantiser is not None:
                requantiser.close()
        return BuildResult(
            out=dest,
            fingerprint=model.fingerprint,
            layout=placement.layout,
            alignment=alignment,
            blocks=[b.block for b in placement.blocks],
            experts=placement.records,
            payload_bytes=payload,
            store_bytes=store_bytes,
            estimated_bytes=needed,
            source_expert_bytes=sum(t.entry.n_bytes for b in placement.blocks for t in b.tensors),
            seconds=time.perf_counter() - t0,
            plan_binding=basis(plan.model_fingerprint) if plan is not None else None,
            precision=precision,
            warnings=warnings,
        )


def estimated_store_bytes(
    placement: StorePlacement,
    index_of: Callable[[tuple[BlockIndex, ...], Any], StoreIndex],
    requantiser: Requantiser | None,
) -> int:
    """The store's size before it is written, for the free-space check: the data region and
    the index as it will be (``index_of`` makes it from blocks and the precision summary;
    checksums are 64 hex digits whatever they hold). Exact without a precision plan; with
    one, each requantised expert's error entry is counted at its longest, since the errors
    are measured while writing."""
    blocks = tuple(_unsummed(b) for b in placement.blocks)
    index = index_of(blocks, requantiser.summary() if requantiser is not None else None)
    size = placement.data_end + len(_index_bytes(index))
    if requantiser is not None:
        requantised = sum(
            1
            for b in placement.blocks
            for r in b.records
            if any(p.ggml_type != s.ggml_type for p, s in zip(r.parts, b.sources, strict=True))
        )
        size += requantised * _LONGEST_PRECISION_ENTRY + 20  # and the count's digits
    return size


def _unsummed(b: PlacedBlock) -> BlockIndex:
    """``b`` with every record's checksum a placeholder of the same length."""
    records = tuple(replace(r, checksum="0" * 64) for r in b.records)
    return BlockIndex(b.block, b.n_expert, b.sources, records)


_LONGEST_VALUE = {
    "float": -1.7976931348623157e308,
    "float | None": -1.7976931348623157e308,
    "bool": True,
}
"""Each metric type's longest JSON form (integers' is ``-(1 << 63)``)."""


def _longest_precision_entry() -> int:
    """Bytes of the longest entry a requantised expert can add to the index's precision
    summary (every number at its longest form)."""
    metrics = {f.name: _LONGEST_VALUE.get(str(f.type), -(1 << 63)) for f in fields(Metrics)}
    longest_type = max((t.name for t in GGMLQuantizationType), key=len)
    entry = {
        "block": 1 << 32,
        "expert": 1 << 32,
        "type": longest_type,
        "count": 1 << 63,
        "metrics": metrics,
    }
    return len(json.dumps(entry, separators=(",", ":"))) + 1  # and its comma


def _index_bytes(index: StoreIndex) -> bytes:
    return json.dumps(index.to_json(), separators=(",", ":")).encode()


def _plan_record(plan: Plan | None, plan_path: str | os.PathLike[str] | None) -> dict[str, Any]:
    if plan is None:
        return {"given": False}
    return {
        "given": True,
        "path": os.fspath(plan_path) if plan_path is not None else None,
        "source": plan.source,
        "binding": basis(plan.model_fingerprint),
        "model_fingerprint": plan.model_fingerprint,
    }


def _write_records(
    model: MoeModel,
    placement: StorePlacement,
    fd: int,
    requantiser: Requantiser | None,
    progress: ProgressSink,
) -> tuple[BlockIndex, ...]:
    """Every block's records, copied or requantised, then checksummed from the disk.

    A block is checksummed by a thread of its own while the next block is copied (both the
    kernel copy and sha256 run without the GIL), so the build takes about the longer of the
    two, not their sum; at most one block is being checksummed at a time."""
    buf = bytearray(CHUNK)
    src_fds: dict[int, int] = {}
    out: list[BlockIndex] = []
    pending: tuple[Future[BlockIndex], int] | None = None

    def collect() -> None:
        nonlocal pending
        if pending is not None:
            future, nbytes = pending
            pending = None
            out.append(future.result())
            progress.advance(nbytes)

    try:
        with (
            Writeback(fd) as writeback,
            ThreadPoolExecutor(1, thread_name_prefix="moepack-checksum") as hasher,
        ):
            for block in placement.blocks:
                ranges: dict[int, list[tuple[int, int, int]]] = {}
                for rec in block.records:
                    for part, tensor in zip(rec.parts, block.tensors, strict=True):
                        if part.ggml_type == int(tensor.entry.ggml_type):
                            ranges.setdefault(tensor.shard, []).append(
                                (tensor.slice_offset(rec.expert), part.offset, part.size)
                            )
                            continue
                        assert requantiser is not None
                        data = requantiser.part_bytes(model, tensor, rec.expert, part.ggml_type)
                        pwrite_all(fd, data, part.offset)
                        writeback.wrote(len(data))
                        progress.advance(len(data))
                for shard, shard_ranges in sorted(ranges.items()):
                    if shard not in src_fds:
                        path = model.shard_paths[shard]
                        src_fds[shard] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    copier = RangeCopier(src_fds[shard], fd)
                    copy_ranges(copier, shard_ranges, progress.advance, writeback)
                collect()  # the previous block's checksums: its buffer is free again
                nbytes = sum(r.payload_bytes for r in block.records)
                pending = (hasher.submit(_checksummed, block, fd, buf), nbytes)
            collect()
    finally:
        for sfd in src_fds.values():
            os.close(sfd)
    return tuple(out)


def _checksummed(block: PlacedBlock, fd: int, buf: bytearray) -> BlockIndex:
    records = [replace(rec, checksum=record_digest(fd, rec, buf)) for rec in block.records]
    return BlockIndex(block.block, block.n_expert, block.sources, tuple(records))


def record_digest(fd: int, rec: StoredExpert, buf: bytearray) -> str:
    """sha256 of ``rec``'s parts as ``fd`` holds them, read through ``buf``."""
    h = hashlib.sha256()
    view = memoryview(buf)
    for part in rec.parts:
        done = 0
        while done < part.size:
            n = min(len(view), part.size - done)
            pread_exact(fd, view[:n], part.offset + done)
            h.update(view[:n])
            done += n
    return h.hexdigest()


def _write_index(fd: int, placement: StorePlacement, index: StoreIndex) -> int:
    """Write the index after the data and the header before it; return the file's length."""
    raw = _index_bytes(index)
    index_offset = placement.data_end
    pwrite_all(fd, raw, index_offset)
    header = Header(
        alignment=placement.alignment,
        data_offset=placement.data_offset,
        data_end=placement.data_end,
        index_offset=index_offset,
        index_length=len(raw),
        index_sha256=hashlib.sha256(raw).digest(),
    )
    pwrite_all(fd, header.pack(), 0)
    return index_offset + len(raw)


_LONGEST_PRECISION_ENTRY = _longest_precision_entry()
