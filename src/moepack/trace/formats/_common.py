"""Helpers the format modules share (not a format: the registry skips ``_`` modules)."""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ...errors import BadInput
from ...inputs import regular_file
from ...progress import ProgressSink
from ..core import (
    CHUNK_CELLS,
    MAX_EXPERTS,
    NEED_N_EXPERT,
    RoutingTrace,
    TraceNeeds,
    token_chunks,
)

# Optional facts a trace may hold; each format says which ones it carries.
CARRY_WEIGHTS = "weights"
CARRY_PREFILL = "prefill"
CARRY_BLOCK_MAP = "block_map"
CARRY_FINGERPRINT = "fingerprint"
CARRY_PROVENANCE = "provenance"
CARRY_SEGMENTS = "segments"


def lost_items(trace: RoutingTrace, carries: Iterable[str]) -> list[str]:
    """Human descriptions of what ``trace`` holds that a format carrying ``carries`` drops."""
    c = set(carries)
    out: list[str] = []
    if trace.weights is not None and CARRY_WEIGHTS not in c:
        out.append("router weights")
    if trace.segments is not None and CARRY_SEGMENTS not in c:
        out.append(
            f"prompt segments ({trace.prompts} prompts; only the first prompt's prefill of "
            f"{trace.leading_prefill} tokens is kept as the prefill/decode split)"
            if CARRY_PREFILL in c
            else f"prompt segments ({trace.prompts} prompts, {trace.prefill_tokens} prefill tokens)"
        )
    elif trace.prefill_tokens and CARRY_PREFILL not in c:
        out.append(f"prefill/decode split ({trace.prefill_tokens} prefill tokens)")
    if trace.block_map is not None and CARRY_BLOCK_MAP not in c:
        out.append(f"block map {trace.block_map}")
    if trace.model_fingerprint is not None and CARRY_FINGERPRINT not in c:
        out.append(f"model fingerprint {trace.model_fingerprint}")
    if trace.provenance and CARRY_PROVENANCE not in c:
        out.append(f"provenance ({', '.join(sorted(trace.provenance))})")
    return out


def file_size(path: Path) -> int:
    """The size of a trace that must be a regular file (a FIFO or device is refused)."""
    return regular_file(path, "trace file").st_size


def check_body_length(path: Path, actual: int, expected: int, declared: str) -> None:
    """``BadInput`` unless the file holds exactly the ``expected`` body bytes after its header:
    "truncated" when it holds fewer, "trailing bytes" when more. ``declared`` says how the
    header arrives at ``expected`` (e.g. "a body of 4096 bytes")."""
    if actual != expected:
        what = "truncated" if actual < expected else "trailing bytes"
        raise BadInput(
            f"{what}: the header declares {declared}, the file holds {max(actual, 0)}", path
        )


def resolve_n_expert(
    declared: int | None,
    given: int | None,
    given_by: str,
    path: Path,
    *,
    declared_by: str,
    missing: str,
) -> int:
    """The expert count of a format that may or may not record one.

    ``declared``: what the file says (None when silent); ``given``: what the caller supplied,
    and ``given_by`` where it comes from ("" for the caller, e.g. "the model m.gguf has").
    They must agree when both are known. With neither, ``TraceNeeds(missing)``: the count is
    never guessed from the largest id. ``declared_by`` names where the file says it, e.g.
    "the preamble says".
    """
    if given is not None and declared is not None and declared != given:
        theirs = f"{given_by} {given}" if given_by else f"n_expert={given} was given"
        raise BadInput(f"{declared_by} n_expert={declared}, but {theirs}", path)
    n_expert = given if given is not None else declared
    if n_expert is None:
        raise TraceNeeds(
            f"{missing} (moepack never guesses it from the largest id)", path, need=NEED_N_EXPERT
        )
    if not 1 <= n_expert <= MAX_EXPERTS:
        where = declared_by if given is None else (given_by or "the caller gives")
        raise BadInput(
            f"{where} n_expert={n_expert}; moepack accepts 1 to {MAX_EXPERTS:,} experts", path
        )
    return n_expert


def read_exact_head(path: Path, n: int, what: str) -> bytes:
    """The first ``n`` bytes of a regular file, or ``BadInput`` naming ``what`` they hold."""
    regular_file(path, "trace file")
    with open(path, "rb") as fh:
        head = fh.read(n)
    if len(head) < n:
        raise BadInput(f"truncated: the {what} needs {n} bytes, the file has {len(head)}", path)
    return head


def write_array(
    fh: BinaryIO, arr: np.ndarray, dtype: np.dtype, progress: ProgressSink | None = None
) -> int:
    """Write ``arr`` as little-endian ``dtype`` in bounded chunks along axis 0; return bytes."""
    dt = np.dtype(dtype).newbyteorder("<")
    row = int(np.prod(arr.shape[1:])) if arr.ndim > 1 else 1
    total = 0
    for sl in token_chunks(arr.shape[0], row, CHUNK_CELLS):
        part = np.ascontiguousarray(np.asarray(arr[sl]), dtype=dt)
        fh.write(part.data.cast("B"))
        total += part.nbytes
        if progress is not None:
            progress.advance(part.nbytes)
    return total


def crc32_array(arr: np.ndarray, dtype: np.dtype, crc: int = 0) -> int:
    """CRC-32 of ``arr`` as it would be written by ``write_array``."""
    dt = np.dtype(dtype).newbyteorder("<")
    row = int(np.prod(arr.shape[1:])) if arr.ndim > 1 else 1
    for sl in token_chunks(arr.shape[0], row, CHUNK_CELLS):
        part = np.ascontiguousarray(np.asarray(arr[sl]), dtype=dt)
        crc = zlib.crc32(part.data.cast("B"), crc)
    return crc


def jsonable(obj: object, where: str = "provenance") -> object:
    """``obj`` as plain JSON values (numpy scalars and arrays converted), or ``BadInput``."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v, where) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v, where) for v in obj]
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist(), where)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if isinstance(obj, Path):
        return str(obj)
    raise BadInput(f"{where} holds a {type(obj).__name__}, which cannot be stored as JSON")
