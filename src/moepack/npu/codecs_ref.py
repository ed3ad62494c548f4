"""Slow scalar versions of the tile codecs, written straight from the formulas.

They exist only to check the vectorised codecs bit for bit; every weight is computed with
numpy float32 scalars, one at a time, from the byte positions the reference gives.
"""

from __future__ import annotations

import struct

import numpy as np


def _bf16(tile: bytes, index: int, base: int = 0) -> np.float32:
    (u,) = struct.unpack_from("<H", tile, base + 2 * index)
    return np.frombuffer(struct.pack("<I", u << 16), dtype=np.float32)[0]


def q4nx_weight(tile: bytes, lr: int, cc: int) -> np.float32:
    g = cc // 32
    scale = _bf16(tile, g * 32 + lr)
    zp = _bf16(tile, g * 32 + lr, base=512)
    byte = tile[1024 + (lr // 16) * 2048 + cc * 8 + (lr % 16) // 2]
    q = byte & 0x0F if lr % 2 == 0 else byte >> 4
    return (np.float32(q) - zp) * scale


def q8_0_weight(tile: bytes, lr: int, col: int) -> np.float32:
    scale = _bf16(tile, (col // 32) * 32 + lr)
    (q,) = struct.unpack_from("<b", tile, 512 + lr * 256 + col)
    return np.float32(q) * scale


def dequantize_tile(tile: bytes, kind: str) -> np.ndarray:
    f = q4nx_weight if kind == "q4nx" else q8_0_weight
    out = np.empty((32, 256), dtype=np.float32)
    for lr in range(32):
        for cc in range(256):
            out[lr, cc] = f(tile, lr, cc)
    return out
