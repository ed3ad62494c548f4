"""What every token reads stays in memory: the model's dense bytes locked in the page cache.

Attention, norms, routers, shared experts, embeddings and the output matrix are read by every
token. Under memory pressure the kernel evicts their pages like any other, and each token
faults them back in, each fault reading a whole read-around window (8 MiB on some virtual
disks) that is mostly expert bytes. Locking them (``mlock`` of those ranges through a mapping
of this process's own: the pages are the page cache's, so llama.cpp's mapping of the same file
finds them resident) costs their size in RAM and saves those faults.

Without the privilege to lock that much (``RLIMIT_MEMLOCK``), ``pin`` raises one line that
says what to raise.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ...checkpoint.model import MoeModel
from ...errors import BadInput
from ...storage.linux import LIBC, MAP_FAILED, PAGE_SIZE
from .prefetch import FileRange, merge_ranges

_libc = LIBC


def dense_tensors(model: MoeModel) -> dict[str, FileRange]:
    """Every tensor but the routed experts' matrices, by name: its page-aligned range."""
    experts = {t.entry.name for b in model.blocks for t in b.weight_tensors}
    out = {}
    for name, entry in model.tensors.items():
        if name in experts or entry.n_bytes == 0:
            continue
        lo = entry.offset // PAGE_SIZE * PAGE_SIZE
        hi = -(-entry.end // PAGE_SIZE) * PAGE_SIZE
        out[name] = FileRange(model.tensor_shard[name], lo, hi - lo)
    return out


def dense_ranges(model: MoeModel) -> list[FileRange]:
    """Every tensor's bytes but the routed experts' matrices, page-aligned and merged."""
    return merge_ranges(list(dense_tensors(model).values()))


def _limit_text(nbytes: int) -> str:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    now = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft:,} bytes"
    return (
        f"cannot lock {nbytes:,} bytes of dense weights in memory (RLIMIT_MEMLOCK is {now}): "
        f"raise it to at least {nbytes:,} bytes (ulimit -l {-(-nbytes // 1024)}, or "
        "LimitMEMLOCK= in a systemd unit), or turn dense pinning off"
    )


@dataclass
class PinnedRanges:
    """Locked ranges of the shards, through read-only maps of this process's own."""

    bytes: int
    ranges: int
    _maps: list[tuple[int, int]]  # (address, length)

    def close(self) -> None:
        for addr, length in self._maps:
            _libc.munmap(addr, length)  # unmapping unlocks
        self._maps.clear()
        self.bytes = 0


def _map(path: Path) -> tuple[int, int]:
    """A read-only shared map of the whole file: (address, length)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0, 0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(path))
        return int(addr), size
    finally:
        os.close(fd)


def pin(paths: Sequence[Path], ranges: Sequence[FileRange]) -> PinnedRanges:
    """Lock ``ranges`` of the shards ``paths`` into memory (reading what is not cached)."""
    total = sum(r.length for r in ranges)
    held = PinnedRanges(0, len(ranges), [])
    try:
        held._maps.extend(_map(p) for p in paths)
        for r in ranges:
            addr, size = held._maps[r.shard]
            end = min(r.end, size)
            if end <= r.offset:
                continue
            if _libc.mlock(addr + r.offset, end - r.offset) != 0:
                err = ctypes.get_errno()
                if err in (1, 11, 12):  # EPERM, EAGAIN, ENOMEM: over the limit
                    raise BadInput(_limit_text(total))
                raise OSError(err, os.strerror(err))
            held.bytes += end - r.offset
    except BaseException:
        held.close()
        raise
    return held
