"""The slow reference packer: one unit at a time, the way the runtime's memcpys are described.

It reads the placements directly (no segments, no granules, no index arrays) and copies each
unit with plain slicing; pair-interleaved units copy 512-B chunk by chunk. It exists only to
cross-check the fast packer on every profile; never use it for real work.
"""

from __future__ import annotations

import numpy as np

from .plan import TensorRef
from .profile import CHUNK, BufferSpec, Placement


def pack_buffer_ref(spec: BufferSpec, refs: list[TensorRef], src: bytes | np.ndarray) -> bytearray:
    out = bytearray(spec.size)
    data = memoryview(src if isinstance(src, bytes) else np.ascontiguousarray(src).data).cast("B")
    for p, ref in zip(spec.placements, refs, strict=True):

        def unit(k: int, p: Placement = p, ref: TensorRef = ref) -> bytes:
            start = ref.start + p.src_origin + int(p.order[k]) * p.src_pitch
            return bytes(data[start : start + p.unit_size])

        left = p.nbytes
        k = 0
        while k < p.count:
            run_i, in_run = divmod(k, p.run)
            dst = p.offset + run_i * (p.run * p.unit_size + p.gap) + in_run * p.unit_size
            if p.scheme == "pair512":
                a, b = unit(k), unit(k + 1)
                for c in range(p.unit_size // CHUNK):
                    at = dst + 2 * CHUNK * c
                    out[at : at + CHUNK] = a[CHUNK * c : CHUNK * (c + 1)]
                    out[at + CHUNK : at + 2 * CHUNK] = b[CHUNK * c : CHUNK * (c + 1)]
                k += 2
                left -= 2 * p.unit_size
            else:
                u = unit(k)[: max(0, min(p.unit_size, left))]
                out[dst : dst + len(u)] = u
                left -= len(u)
                k += 1
    return out
