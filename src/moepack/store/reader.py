"""Opening an expert store: the interface replay, verify and users read a store through.

``open_store(path)`` checks the header, the index's digest and the index itself (``index``)
and returns an ``ExpertStore``: where each expert's record lies in ``data_path``. Reading a
record is then one request, ``[rec.offset, rec.offset + rec.size)``, aligned for O_DIRECT.
Nothing is read from the data region here; ``read_record`` is a convenience for small reads.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import TracebackType

from ..errors import BadInput
from ..inputs import load_json, regular_file
from ..safeio import os_error_text
from .format import HEADER, Header, check_alignment, unpack_header
from .index import BlockIndex, StoredExpert, StoredPart, StoreIndex, decode_index

MAX_INDEX_BYTES = 256 << 20

__all__ = ["ExpertStore", "StoredExpert", "StoredPart", "open_store"]


class ExpertStore:
    """An opened store (a context manager; ``close`` releases the file)."""

    def __init__(self, path: Path, header: Header, index: StoreIndex, fd: int) -> None:
        self.path = path  # what the user named (the store)
        self.data_path = path  # the file the offsets point into (one file holds everything)
        self.header = header
        self.index = index
        self.fingerprint = index.fingerprint  # the source model's MoeModel.fingerprint
        self.alignment = header.alignment  # every record starts on this boundary
        self._by_block: dict[int, BlockIndex] = {b.block: b for b in index.blocks}
        self.blocks: list[int] = sorted(self._by_block)  # MoE block indices held
        counts = {b.n_expert for b in index.blocks}
        self.n_expert = counts.pop() if len(counts) == 1 else -1  # -1: varies by block
        self._lookup = {(e.block, e.expert): e for b in index.blocks for e in b.experts}
        self._fd: int | None = fd

    def block_index(self, block: int) -> BlockIndex:
        """``block``'s records and source parts; ``BadInput`` when the store lacks it."""
        found = self._by_block.get(block)
        if found is None:
            raise BadInput(f"block {block} is not in this store (blocks: {self.blocks})", self.path)
        return found

    def expert(self, block: int, expert: int) -> StoredExpert:
        """The record of original expert ``expert`` of ``block``."""
        rec = self._lookup.get((block, expert))
        if rec is None:
            self.block_index(block)
            raise BadInput(f"block {block} has no expert {expert}", self.path)
        return rec

    def experts(self, block: int) -> list[StoredExpert]:
        """``block``'s records in storage order."""
        return list(self.block_index(block).experts)

    def all_experts(self) -> list[StoredExpert]:
        """Every record, in file order."""
        return sorted(self._lookup.values(), key=lambda e: e.offset)

    @property
    def data_bytes(self) -> int:
        return self.header.data_end - self.header.data_offset

    @property
    def payload_bytes(self) -> int:
        """The parts' bytes (records without their padding)."""
        return sum(e.payload_bytes for e in self._lookup.values())

    def fileno(self) -> int:
        if self._fd is None:
            raise ValueError("the store is closed")
        return self._fd

    def read_record(self, rec: StoredExpert) -> bytes:
        """The parts' bytes of ``rec`` (``span``), with one pread."""
        start, end = rec.span
        data = os.pread(self.fileno(), end - start, start)
        if len(data) != end - start:
            raise BadInput(f"ends inside block {rec.block} expert {rec.expert}'s record", self.path)
        return data

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ExpertStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def open_store(path: str | os.PathLike[str]) -> ExpertStore:
    """Open the store at ``path``; ``BadInput`` (one line naming the file) on a bad store."""
    p = Path(path)
    st = regular_file(p, "expert store")
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise BadInput(f"cannot read the expert store: {os_error_text(e)}", p) from None
    try:
        header, index = _read(p, fd, st.st_size)
        return ExpertStore(p, header, index, fd)
    except BaseException:
        os.close(fd)
        raise


def _read(p: Path, fd: int, file_size: int) -> tuple[Header, StoreIndex]:
    got = unpack_header(os.pread(fd, HEADER.size, 0))
    if isinstance(got, str):
        raise BadInput(got, p)
    h = got
    why = check_alignment(h.alignment)
    if why is not None:
        raise BadInput(f"store header: {why}", p)
    if not (HEADER.size <= h.data_offset <= h.data_end <= h.index_offset):
        raise BadInput("store header: its regions are out of order", p)
    if h.data_offset % h.alignment:
        raise BadInput("store header: the data region is not aligned", p)
    if h.index_length > MAX_INDEX_BYTES:
        raise BadInput(f"store index of {h.index_length:,} bytes is larger than allowed", p)
    if h.index_offset + h.index_length > file_size:
        raise BadInput(
            f"is truncated: the index ends at byte {h.index_offset + h.index_length:,}, "
            f"the file has {file_size:,}",
            p,
        )
    raw = os.pread(fd, h.index_length, h.index_offset)
    if len(raw) != h.index_length:
        raise BadInput("changed while being read (the index is short)", p)
    if hashlib.sha256(raw).digest() != h.index_sha256:
        raise BadInput("store index is corrupt (its sha256 differs from the header's)", p)
    doc = load_json(raw, p, "store index", max_bytes=MAX_INDEX_BYTES)
    return h, decode_index(doc, h, p)
