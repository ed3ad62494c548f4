"""``verify_store``: every slice of a store against its model, and every record's checksum.

A part stored at its source type must equal the source slice byte for byte; a part a precision
plan requantised must equal the requantisation the index records (the same quantiser run again
on the source slice: ggml's and gguf-py's quantisers are deterministic). Each record's sha256 is
recomputed from the store's bytes, so a corrupted slice is found and named even when the model
is not the one at hand. A store built from another model is bad input (exit 2), not a failed
check. Memory: two pairs of 4 MiB buffers, whatever the model's size.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from gguf.constants import GGMLQuantizationType

from ..checkpoint.experts import significant_ne
from ..checkpoint.model import ExpertTensor, MoeModel
from ..errors import BadInput
from ..progress import NULL_PROGRESS, ProgressSink
from ..storage.copy import pread_exact
from .index import BlockIndex, StoredExpert, StoredPart
from .precision_apply import Requantisation, requantiser_from_index
from .reader import ExpertStore, open_store

BUFFER = 4 << 20
THREADS = 2
MAX_LISTED = 100


@dataclass(frozen=True)
class SliceDifference:
    """One part of one record that is not what it should be."""

    block: int
    expert: int
    slot: int
    part: str
    tensor: str
    store_offset: int  # absolute offset in the store of the first wrong byte (or the part)
    checksum_ok: bool  # the record's sha256 still matches its bytes
    message: str

    def to_json(self) -> dict[str, Any]:
        return {
            "block": self.block,
            "expert": self.expert,
            "slot": self.slot,
            "part": self.part,
            "tensor": self.tensor,
            "store_offset": self.store_offset,
            "checksum_ok": self.checksum_ok,
            "message": self.message,
        }


@dataclass
class StoreVerifyResult:
    store: Path
    model: Path
    fingerprint: str
    records: int = 0
    parts_verbatim: int = 0
    parts_requantised: int = 0
    bytes_compared: int = 0
    checksum_failures: int = 0
    differences: list[SliceDifference] = field(default_factory=list)
    differences_total: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.differences_total == 0

    @property
    def first(self) -> SliceDifference | None:
        return self.differences[0] if self.differences else None

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "store": str(self.store),
            "model": str(self.model),
            "fingerprint": self.fingerprint,
            "records": self.records,
            "parts_verbatim": self.parts_verbatim,
            "parts_requantised": self.parts_requantised,
            "bytes_compared": self.bytes_compared,
            "checksum_failures": self.checksum_failures,
            "differences_total": self.differences_total,
            "differences": [d.to_json() for d in self.differences],
            "seconds": self.seconds,
        }


def verify_store(
    store_path: str | os.PathLike[str],
    model_path: str | os.PathLike[str],
    progress: ProgressSink = NULL_PROGRESS,
) -> StoreVerifyResult:
    """Check ``store_path`` against ``model_path`` (see the module docstring)."""
    t0 = time.perf_counter()
    with open_store(store_path) as store, MoeModel(model_path) as model:
        if store.fingerprint != model.fingerprint:
            raise BadInput(
                f"this store was built from the model with fingerprint {store.fingerprint}, but "
                f"{model.path} has fingerprint {model.fingerprint} (another model, or a "
                "repacked copy)",
                store.path,
            )
        tensors = {b: _block_tensors(store, model, b) for b in store.blocks}
        requant = requantiser_from_index(store.index.precision, store.path)
        result = StoreVerifyResult(store.path, model.path, store.fingerprint)
        progress.start(f"verifying {store.path.name}", store.payload_bytes)
        checker = _Checker(store, model, result, progress)
        work = [(rec, tensors[b]) for b in store.blocks for rec in store.experts(b)]
        try:
            checker.run(work, requant)
        finally:
            checker.close()
            progress.finish()
            if requant is not None:
                requant.close()
        result.seconds = time.perf_counter() - t0
        return result


def _block_tensors(store: ExpertStore, model: MoeModel, block: int) -> list[ExpertTensor]:
    """The model's tensor behind each of ``block``'s parts, found by the names the index
    records (so verify needs no --assume-* flags the build had); ``BadInput`` when one is
    missing or differs in type or shape."""
    bi: BlockIndex = store.block_index(block)
    out: list[ExpertTensor] = []
    for src in bi.sources:
        entry = model.tensors.get(src.tensor)
        shape = tuple(significant_ne(entry.ne)) if entry is not None else ()
        if (
            entry is None
            or int(entry.ggml_type) != src.ggml_type
            or shape != (*src.shape, bi.n_expert)
        ):
            raise BadInput(
                f"{model.path} has no tensor {src.tensor} of type {src.ggml_type} and shape "
                f"{[*src.shape, bi.n_expert]}, which block {block} of the store holds",
                store.path,
            )
        shard = model.tensor_shard[src.tensor]
        out.append(ExpertTensor(entry, shard, block, src.kind, bi.n_expert))
    return out


@dataclass
class _Outcome:
    """What checking one record found (gathered in order by the main thread)."""

    rec: StoredExpert
    verbatim: int = 0
    requantised: int = 0
    compared: int = 0
    checksum_ok: bool = True
    wrong: list[tuple[StoredPart, ExpertTensor, int, str]] = field(default_factory=list)


class _Checker:
    """Compares parts with their sources and recomputes the records' checksums.

    Records are checked by two threads at once (preads, sha256, the comparison and ggml's
    quantisers all run without the GIL), each through two buffers of its own; results are
    gathered in storage order. Memory: two buffer pairs, whatever the store's size."""

    def __init__(
        self,
        store: ExpertStore,
        model: MoeModel,
        result: StoreVerifyResult,
        progress: ProgressSink,
    ) -> None:
        self.store = store
        self.model = model
        self.result = result
        self.progress = progress
        self.fds = {
            i: os.open(path, os.O_RDONLY | os.O_CLOEXEC) for i, path in enumerate(model.shard_paths)
        }
        self._buffers = threading.local()

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def run(
        self,
        work: list[tuple[StoredExpert, list[ExpertTensor]]],
        requant: Requantisation | None,
    ) -> None:
        def check(item: tuple[StoredExpert, list[ExpertTensor]]) -> _Outcome:
            return self._check(item[0], item[1], requant)

        with ThreadPoolExecutor(THREADS, thread_name_prefix="moepack-verify") as pool:
            for outcome in _in_order(pool, check, iter(work), 2 * THREADS):
                self._gather(outcome)

    def _buffers_of_thread(self) -> tuple[bytearray, bytearray]:
        pair = getattr(self._buffers, "pair", None)
        if pair is None:
            pair = self._buffers.pair = (bytearray(BUFFER), bytearray(BUFFER))
        return pair

    def _check(
        self, rec: StoredExpert, tensors: list[ExpertTensor], requant: Requantisation | None
    ) -> _Outcome:
        out = _Outcome(rec)
        mine, theirs = self._buffers_of_thread()
        mine_v, theirs_v = memoryview(mine), memoryview(theirs)
        digest = hashlib.sha256()
        store_fd = self.store.fileno()
        for part, tensor in zip(rec.parts, tensors, strict=True):
            expected: bytes | None = None
            if part.ggml_type == int(tensor.entry.ggml_type):
                out.verbatim += 1
                what = f"differs from {tensor.name} expert {rec.expert}"
            else:
                out.requantised += 1
                if requant is None:
                    raise BadInput(
                        f"block {rec.block} expert {rec.expert}'s {part.kind} is stored as "
                        f"{part.type_name} but the index records no precision plan",
                        self.store.path,
                    )
                expected = requant.part_bytes(self.model, tensor, rec.expert, part.ggml_type)
                what = (
                    f"differs from {tensor.name} expert {rec.expert} requantised to "
                    f"{GGMLQuantizationType(part.ggml_type).name}"
                )
            src = tensor.slice_offset(rec.expert)
            first: int | None = None
            for lo in range(0, part.size, BUFFER):
                n = min(BUFFER, part.size - lo)
                pread_exact(store_fd, mine_v[:n], part.offset + lo)
                digest.update(mine_v[:n])
                if expected is None:
                    pread_exact(self.fds[tensor.shard], theirs_v[:n], src + lo)
                    other: bytes | bytearray = theirs if n == BUFFER else theirs[:n]
                else:
                    other = expected[lo : lo + n]
                got = mine if n == BUFFER else mine[:n]
                if first is None and got != other:  # bytearray == bytes is one memcmp
                    first = part.offset + lo + _first_difference(got, other)
                out.compared += n
            if first is not None:
                out.wrong.append((part, tensor, first, what))
        out.checksum_ok = digest.hexdigest() == rec.checksum
        if not out.checksum_ok and not out.wrong:
            # the bytes match the model yet not the checksum: the index is wrong
            part = rec.parts[0]
            out.wrong.append((part, tensors[0], part.offset, "does not match its checksum"))
        return out

    def _gather(self, out: _Outcome) -> None:
        r, rec = self.result, out.rec
        r.records += 1
        r.parts_verbatim += out.verbatim
        r.parts_requantised += out.requantised
        r.bytes_compared += out.compared
        self.progress.advance(out.compared)
        if not out.checksum_ok:
            r.checksum_failures += 1
        for part, tensor, at, what in out.wrong:
            r.differences_total += 1
            if len(r.differences) < MAX_LISTED:
                state = "matches" if out.checksum_ok else "fails"
                message = (
                    f"block {rec.block} expert {rec.expert} (slot {rec.slot}) {part.kind}: "
                    f"byte {at - part.offset:,} of the slice (store offset {at:,}) {what}; "
                    f"the record {state} its checksum"
                )
                r.differences.append(
                    SliceDifference(
                        rec.block,
                        rec.expert,
                        rec.slot,
                        part.kind,
                        tensor.name,
                        at,
                        out.checksum_ok,
                        message,
                    )
                )


T = TypeVar("T")
R = TypeVar("R")


def _in_order(
    pool: ThreadPoolExecutor, fn: Callable[[T], R], items: Iterator[T], ahead: int
) -> Iterator[R]:
    """``fn`` of each item, in order, with up to ``ahead`` calls running or done in advance."""
    queue: deque[Future[R]] = deque()
    for item in items:
        queue.append(pool.submit(fn, item))
        if len(queue) >= ahead:
            yield queue.popleft().result()
    while queue:
        yield queue.popleft().result()


def _first_difference(a: bytes | bytearray, b: bytes | bytearray) -> int:
    x = np.frombuffer(a, dtype=np.uint8)
    y = np.frombuffer(b, dtype=np.uint8)
    return int(np.flatnonzero(x != y)[0])
