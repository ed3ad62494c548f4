"""Writing a rewritten model: its output shards as one group, and a described shard.

``write_outputs`` is what every rewrite (repack's permutation and layout paths, undo) shares:
where each shard goes, the checks on the destinations and the free space, and the shards
written through ``AtomicOutputs`` so that all appear or none does. ``write_target_shard``
writes one shard described by ``target`` (header, padding, every tensor's ranges, from
whichever shards of the source they come), streamed:
the byte moving is ``copy.copy_ranges`` (in the kernel where it can, with read-ahead and early
writeback), so a layout rewrite streams with the same bounded memory as a permutation.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from ..checkpoint.model import SPLIT_RE, MoeModel
from ..errors import MoepackError
from ..filekinds import GGUF, check_output_kind
from ..progress import ProgressSink
from ..safeio import AtomicOutputs, check_destination, check_free_space, describe_os_error
from ..storage.copy import RangeCopier, copy_ranges, pwrite_all, write_zeros
from ..storage.writeback import Writeback
from .target import OutTensor, aligned

MARGIN = 1024 * 1024
"""Room asked for beyond the output's bytes (directory entries, the journal of a group)."""


def output_paths(model: MoeModel, out: str | os.PathLike[str], n: int | None = None) -> list[Path]:
    """Where each of ``n`` shards (default: as many as ``model`` has) goes: ``out`` itself,
    or ``STEM-0000i-of-0000N.gguf`` beside it."""
    dest = Path(out)
    n = len(model.shards) if n is None else n
    if n == 1:
        return [dest]
    m = SPLIT_RE.match(dest.name)
    stem = m.group("stem") if m else (dest.name[:-5] if dest.name.endswith(".gguf") else dest.name)
    return [dest.with_name(f"{stem}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def write_outputs(
    model: MoeModel,
    out: str | os.PathLike[str],
    inputs: list[Path],
    write: Callable[[int, int], int],
    *,
    need_bytes: int,
    what: str,
    label: str,
    progress: ProgressSink,
    shards: int | None = None,
) -> tuple[list[Path], int]:
    """Write ``shards`` output shards (default: one per shard of ``model``; at
    ``output_paths``) as one all-or-nothing group: each destination a GGUF name that is none
    of ``inputs``, room for ``need_bytes`` (``what`` the error calls them), then
    ``write(shard, fd)`` for every shard, which returns the shard's length. Returns the paths
    and the bytes written."""
    dests = output_paths(model, out, shards)
    for d in dests:
        check_destination(d, inputs)
        check_output_kind(d, GGUF)
    check_free_space(dests[0].parent, need_bytes + MARGIN, what)
    progress.start(label, sum(t.n_bytes for t in model.tensors.values()))
    written = 0
    try:
        with AtomicOutputs(inputs) as outs:
            for i, dest in enumerate(dests):
                written += write(i, outs.open(dest).fileno())
    except OSError as e:
        raise describe_os_error(e, dests[0]) from None
    finally:
        progress.finish()
    return dests, written


def write_target_shard(
    sources: Sequence[Path],
    dst_fd: int,
    header: bytes,
    tensors: list[OutTensor],
    alignment: int,
    data_bytes: int,
    progress: ProgressSink,
) -> int:
    """Write one output shard whose tensors come from the shards ``sources`` of the source
    model (each range read from the shard it names); returns the file length."""
    data_start = aligned(len(header), alignment)
    pwrite_all(dst_fd, header, 0)
    write_zeros(dst_fd, len(header), data_start - len(header))
    runs: list[tuple[int, list[tuple[int, int, int]]]] = []  # (source shard, its ranges)
    pos = 0
    for t in tensors:
        write_zeros(dst_fd, data_start + pos, t.rel_offset - pos)
        for shard, src, dst, n in t.ranges(data_start):
            if not 0 <= shard < len(sources):
                raise MoepackError(f"internal: tensor {t.name!r} names source shard {shard}")
            if not runs or runs[-1][0] != shard:
                runs.append((shard, []))
            runs[-1][1].append((src, dst, n))
        pos = t.rel_offset + t.n_bytes
    copiers: dict[int, RangeCopier] = {}  # one per source shard, opened when first needed
    try:
        with Writeback(dst_fd) as writeback:
            for shard, ranges in runs:
                if shard not in copiers:
                    copiers[shard] = RangeCopier(os.open(sources[shard], os.O_RDONLY), dst_fd)
                copy_ranges(copiers[shard], ranges, progress.advance, writeback)
    finally:
        for copier in copiers.values():
            os.close(copier.src_fd)
    write_zeros(dst_fd, data_start + pos, data_bytes - pos)
    return data_start + data_bytes
