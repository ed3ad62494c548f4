"""Read source bytes back out of packed buffers through a profile's layout (its inverse).

Used to dequantise a tile straight from device buffers and compare it with the source file;
it reports which bytes no buffer keeps (e.g. the seed's trimmed 384-B tails), so a tile that
is not fully retained is never silently dequantised from zeros.
"""

from __future__ import annotations

import numpy as np

from .codecs import dequantize
from .plan import LayerPackPlan


def source_bytes(
    plan: LayerPackPlan, buffers: dict[str, np.ndarray], role: str, start: int, length: int
) -> tuple[np.ndarray, np.ndarray]:
    """Bytes ``[start, start+length)`` of a tensor as the buffers hold them, and a mask of
    which of those bytes some buffer actually holds."""
    ref = plan.tensors[role]
    lo, hi = ref.start + start, ref.start + start + length
    out = np.zeros(length, np.uint8)
    have = np.zeros(length, bool)
    for bp in plan.buffers:
        buf = buffers[bp.name]
        for seg in bp.segments:
            src = seg.src_abs() + bp.base
            hit = np.flatnonzero((src < hi) & (src + seg.g > lo))
            for i in hit.tolist():
                s = int(src[i])
                a, b = max(s, lo), min(s + seg.g, hi)
                d = seg.dst + i * seg.g + (a - s)
                out[a - lo : b - lo] = buf[d : d + (b - a)]
                have[a - lo : b - lo] = True
    return out, have


def dequantize_tile(
    plan: LayerPackPlan, buffers: dict[str, np.ndarray], role: str, tile: int
) -> np.ndarray | None:
    """A tile's weights read through the packed buffers, or None if any byte is not kept."""
    size = plan.tensors[role].shape.tile_size
    if size is None:
        raise ValueError(f"{role} is not a tile tensor")
    data, have = source_bytes(plan, buffers, role, tile * size, size)
    if not have.all():
        return None
    return dequantize(data, size)[0]
