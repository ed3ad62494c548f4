"""The peer tool's binary trace, ``.pmxtrace`` (versions 1 and 2; version 2 is written).

Little-endian: ``"PMXTRACE"`` · u32 version · u32 n_layers · u32 n_experts · u32 top_k ·
u64 n_tokens · (v2) u64 prefill_tokens · u32 expert ids, n_tokens × n_layers × top_k,
token-major then layer-major. Checked as the peer checks (shape fields non-zero, top_k ≤
n_experts, exact body length, ids < n_experts, prefill ≤ n_tokens) and, like every trace,
no expert twice in one (token, layer) row. The body is memory-mapped, not loaded.

The format carries no router weights, block map, model fingerprint or provenance (trace layer
``i`` means the model's ``i``-th MoE block); version 1 has no prefill split either.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ...errors import BadInput
from ..core import RoutingTrace, check_trace_shape
from ._api import FormatModule, ReadOptions, WriteOptions
from ._common import (
    CARRY_PREFILL,
    check_body_length,
    file_size,
    lost_items,
    read_exact_head,
    write_array,
)

NAME = "pmxtrace"
EXTENSIONS = (".pmxtrace",)
DESCRIPTION = "potatomaxx binary trace (v2 with prefill split; v1 read and written on request)"
VERSIONS = (2, 1)
MAGIC = b"PMXTRACE"
_HEAD = struct.Struct("<8sIIIIQ")  # v1 header, 28 bytes
_PREFILL = struct.Struct("<Q")
U32_MAX = 0xFFFFFFFF


def header_size(version: int) -> int:
    return _HEAD.size + (_PREFILL.size if version >= 2 else 0)


def detect(head: bytes) -> bool:
    return head.startswith(MAGIC)


def read(path: Path, options: ReadOptions) -> RoutingTrace:
    head = read_exact_head(path, 12, "pmxtrace magic and version")
    if head[:8] != MAGIC:
        raise BadInput(f"not a pmxtrace file: magic is {head[:8]!r}, expected {MAGIC!r}", path)
    version = struct.unpack_from("<I", head, 8)[0]
    if version not in (1, 2):
        raise BadInput(f"unsupported pmxtrace version {version} (this reads 1 and 2)", path)
    hsize = header_size(version)
    head = read_exact_head(path, hsize, f"pmxtrace v{version} header")
    _m, _v, n_layers, n_experts, top_k, n_tokens = _HEAD.unpack_from(head)
    prefill = _PREFILL.unpack_from(head, _HEAD.size)[0] if version >= 2 else 0
    if n_layers == 0 or n_experts == 0 or top_k == 0:
        raise BadInput(
            f"bad pmxtrace header: n_layers={n_layers}, n_experts={n_experts}, "
            f"top_k={top_k} must all be non-zero",
            path,
        )
    if top_k > n_experts:
        raise BadInput(f"bad pmxtrace header: top_k {top_k} exceeds n_experts {n_experts}", path)
    check_trace_shape(n_experts, n_layers, top_k, path, "the pmxtrace header")
    if prefill > n_tokens:
        raise BadInput(
            f"bad pmxtrace header: {prefill} prefill tokens of {n_tokens} in total", path
        )
    expected = n_tokens * n_layers * top_k * 4
    check_body_length(
        path,
        file_size(path) - hsize,
        expected,
        f"{n_tokens} tokens × {n_layers} layers × top-{top_k} = {expected} body bytes",
    )
    if n_tokens == 0:
        raise BadInput("the pmxtrace holds no tokens", path)
    ids = np.memmap(path, dtype="<u4", mode="r", offset=hsize, shape=(n_tokens, n_layers, top_k))
    return RoutingTrace(
        ids=ids,
        n_expert=n_experts,
        prefill_tokens=prefill,
        provenance={"source": f"pmxtrace v{version}"},
        path=path,
    )


def lost(trace: RoutingTrace, options: WriteOptions) -> list[str]:
    carries = (CARRY_PREFILL,) if (options.version or VERSIONS[0]) >= 2 else ()
    return lost_items(trace, carries)


def write(trace: RoutingTrace, fh: BinaryIO, options: WriteOptions) -> None:
    version = options.version or VERSIONS[0]
    if trace.n_expert > U32_MAX:
        raise BadInput(
            f"pmxtrace holds at most {U32_MAX} experts, not {trace.n_expert}", options.path
        )
    fh.write(_HEAD.pack(MAGIC, version, trace.layers, trace.n_expert, trace.k, trace.tokens))
    if version >= 2:
        fh.write(_PREFILL.pack(trace.leading_prefill))
    options.progress.start("writing pmxtrace", trace.ids.size * 4)
    try:
        write_array(fh, trace.ids, np.dtype(np.uint32), options.progress)
    finally:
        options.progress.finish()


PLUGIN = FormatModule(__name__)
