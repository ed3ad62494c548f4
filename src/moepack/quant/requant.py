"""Requantising one expert slice: dequantise the source, quantise to the target type, and
measure what the expert lost with ``compare``'s metrics, in bounded row chunks.

The source is decoded by ggml's own ``to_float`` where available (the decoder llama.cpp runs),
else gguf-py's; the result is decoded the same way to measure it. Memory: one chunk of rows as
float32 (at most ``CHUNK_VALUES`` values) and its quantised bytes, whatever the slice's size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from .engine import DEQUANT_ENGINES, DequantEngine, engine_for
from .metrics import DiffStats
from .quantiser import Quantiser

CHUNK_VALUES = 1 << 22
"""Values decoded and re-encoded at a time (16 MiB of float32)."""


@dataclass
class Requantised:
    """A slice's new bytes and how far its values moved."""

    data: bytes
    stats: DiffStats


def row_bytes(qtype: GGMLQuantizationType, n_per_row: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return n_per_row // block * size


def decoder(qtype: GGMLQuantizationType) -> DequantEngine:
    """ggml's decoder for ``qtype`` when it has one, else any engine that decodes it."""
    found = engine_for(qtype, DEQUANT_ENGINES.get("ggml"))
    if found is None:
        raise ValueError(f"no engine decodes {qtype.name}")
    return found


def requantise(
    raw: np.ndarray,
    src_type: GGMLQuantizationType,
    dst_type: GGMLQuantizationType,
    n_per_row: int,
    quantiser: Quantiser,
) -> Requantised:
    """``raw`` (uint8: whole rows of ``src_type``, ``n_per_row`` values each) as ``dst_type``."""
    src_row = row_bytes(src_type, n_per_row)
    n_rows = raw.size // src_row
    step = max(1, CHUNK_VALUES // n_per_row)
    dec_src, dec_dst = decoder(src_type), decoder(dst_type)
    stats = DiffStats()
    out = bytearray()
    for lo in range(0, n_rows, step):
        hi = min(n_rows, lo + step)
        chunk = np.ascontiguousarray(raw[lo * src_row : hi * src_row])
        values = dec_src.dequantize(chunk, src_type).reshape(hi - lo, n_per_row)
        q = quantiser.quantize(values, dst_type)
        back = dec_dst.dequantize(q, dst_type)
        stats.add(values.reshape(-1), back)
        out += q.tobytes()
    return Requantised(bytes(out), stats)
