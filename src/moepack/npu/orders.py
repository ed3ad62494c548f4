"""Unit orders from the reverse-engineering notes, each a vectorised formula.

Every function returns the *source unit index* of each output unit, in output order. The
docstring quotes the formula it implements; tests re-derive each one with scalar loops.
"""

from __future__ import annotations

import numpy as np

DOWN8 = np.array([0, 2, 4, 6, 1, 3, 5, 7], dtype=np.int64)


def block32_rows(n_blocks: int) -> np.ndarray:
    """``r_i = 32b + 8(i % 4) + i // 4`` for i = 0..31 in each block b (up / gate)."""
    i = np.arange(32, dtype=np.int64)
    return (32 * np.arange(n_blocks, dtype=np.int64)[:, None] + 8 * (i % 4) + i // 4).ravel()


def block16_down(n_blocks: int) -> np.ndarray:
    """``d_i = 16b + 8(i // 8) + [0,2,4,6,1,3,5,7][i % 8]`` for i = 0..15 (down, 0.9.46)."""
    i = np.arange(16, dtype=np.int64)
    return (16 * np.arange(n_blocks, dtype=np.int64)[:, None] + 8 * (i // 8) + DOWN8[i % 8]).ravel()


def groups8(n: int) -> np.ndarray:
    """Units in groups of 8 ordered ``8g + [0,2,4,6,1,3,5,7]`` (v1.0.x down windows)."""
    if n % 8:
        raise ValueError(f"{n} units are not whole groups of 8")
    return (8 * np.arange(n // 8, dtype=np.int64)[:, None] + DOWN8).ravel()


def pair_blocks(n: int, h: int, base: int = 0) -> np.ndarray:
    """Region B pairs: per block of 2H tiles, ``(2H*blk + j, 2H*blk + j + H)`` for j < H."""
    if n % (2 * h):
        raise ValueError(f"{n} tiles are not whole blocks of 2H = {2 * h}")
    j = np.arange(h, dtype=np.int64)
    blk = 2 * h * np.arange(n // (2 * h), dtype=np.int64)[:, None, None]
    pairs = np.stack([j, j + h], axis=-1)[None]  # [1, H, 2]
    return (base + blk + pairs).ravel()


def ab16(n: int) -> np.ndarray:
    """The seed's 16-row A/B interleave: ``out[o] = in[o // 2 + 8(o % 2)]`` per 16-row block."""
    if n % 16:
        raise ValueError(f"{n} rows are not whole 16-row blocks")
    o = np.arange(16, dtype=np.int64)
    return (16 * np.arange(n // 16, dtype=np.int64)[:, None] + o // 2 + 8 * (o % 2)).ravel()


def reorder_105(n: int) -> np.ndarray:
    """v1.0.5 region B: ``out[2H*blk + i] = in[2H*blk + i//2 + H(i%2)]``, ``H = n / 256``;
    H = 0 (n < 256) is the identity."""
    h = n // 256
    if h == 0:
        return np.arange(n, dtype=np.int64)
    if n % (2 * h):
        raise ValueError(f"{n} rows are not whole blocks of 2H = {2 * h}")
    i = np.arange(2 * h, dtype=np.int64)
    return (2 * h * np.arange(n // (2 * h), dtype=np.int64)[:, None] + i // 2 + h * (i % 2)).ravel()


def wrapped_ab(start: int, modulus: int, n_blocks: int) -> np.ndarray:
    """v1.0.x pool gate_proj: pairs ``(v, v + 8 mod M)`` from v = start, 16 rows a block:
    ``(start + 16*blk + i//2 + 8(i%2)) mod M``."""
    i = np.arange(16, dtype=np.int64)
    blk = np.arange(n_blocks, dtype=np.int64)[:, None]
    return ((start + 16 * blk + i // 2 + 8 * (i % 2)) % modulus).ravel()


def ssm_out_105(n: int) -> np.ndarray:
    """v1.0.x norms buffer: ``j = 32b + 16(i % 2) + i // 2`` for i = 0..31, first n rows."""
    i = np.arange(32, dtype=np.int64)
    n_blocks = -(-n // 32)
    return (32 * np.arange(n_blocks, dtype=np.int64)[:, None] + 16 * (i % 2) + i // 2).ravel()[:n]


def seed_k_pairs(n: int, first: int = 232, delta: int = 7) -> np.ndarray:
    """The seed's gate_proj k-order read literally: pairs ``(a, a - 7)`` for a = 232, 233, ...
    giving ``[232, 225, 233, 226, ...]``. Not a permutation (see the seed profile)."""
    a = first + np.arange(-(-n // 2), dtype=np.int64)
    return np.stack([a, a - delta], axis=-1).ravel()[:n]


def transpose(rows: int, cols: int) -> np.ndarray:
    """Element order for ``dst[c*rows + r] = src[r][c]`` (router: experts outer)."""
    c = np.arange(cols, dtype=np.int64)[:, None]
    r = np.arange(rows, dtype=np.int64)[None, :]
    return (r * cols + c).ravel()
