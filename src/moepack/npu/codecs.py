"""Q4NX (5,120-B) and Q8_0 (8,704-B) tile codecs, vectorised over many tiles.

A tile holds 32 rows x 256 columns of weights. Dequantisation follows the reported formulas
exactly, in float32 (checked bit-for-bit against the scalar versions in ``codecs_ref``):

* Q4NX = 512 B BF16 scales | 512 B BF16 zero points | 4,096 B int4. For row ``lr`` and column
  ``cc`` (group ``g = cc // 32``) the scale is BF16 number ``g*32 + lr``, the zero point the
  same index in the second block, the nibble at byte ``1024 + (lr//16)*2048 + cc*8 +
  (lr%16)//2`` (low nibble = even row); ``W = (q - zp) * scale``.
* Q8_0 = 512 B BF16 scales | 8,192 B int8; ``W[lr][c] = int8[lr*256 + c] * scale[(c//32)*32 + lr]``.

Quantisation exists to make synthetic tiles from real-looking weights; it rounds scales up to
BF16 so the range always fits, which gives the error bound ``|W - w| <= scale / 2``.
"""

from __future__ import annotations

import numpy as np

TILE_ROWS = 32
TILE_COLS = 256
GROUP = 32
Q4NX_TILE = 5120
Q8_0_TILE = 8704
# The runtime's element-size oracle get_quantization_byte_size(8192, dtype), as reference §2
# lists it: dtypes 0-5 only. (Read as 8,192 weights' payload + 512 B of BF16 scales, plus
# 512 B of zero points for 2-5: 4-bit 4,096 + 512 = 4,608, Q4NX 5,120; int8 8,192 + 512 =
# 8,704, 9,216 with zero points. That reading is arithmetic, not from the notes.)
RUNTIME_ELEMENT_SIZE: dict[int, int] = {0: 4608, 1: 8704, 2: 5120, 3: 9216, 4: 5120, 5: 9216}

# reorder_cpy is always called with dtype 8, "element size 4,736" (reference §2). That is the
# call's argument as the notes report it, not an output of the oracle above; the notes give
# no breakdown of the 4,736 bytes.
REORDER_CPY_DTYPE = 8
REORDER_CPY_ELEMENT_SIZE = 4736
WINDOW = REORDER_CPY_ELEMENT_SIZE  # the v1.0.x runtime's raw windows (ref §5)


def get_quantization_byte_size(n_weights: int, dtype: int) -> int:
    """The runtime's oracle, for what was observed: 8,192 weights (one tile), dtypes 0-5."""
    if n_weights != TILE_ROWS * TILE_COLS:
        raise ValueError("the oracle was only observed for 8,192 weights (one tile)")
    try:
        return RUNTIME_ELEMENT_SIZE[dtype]
    except KeyError:
        raise ValueError(f"the oracle's output for dtype {dtype} was not observed") from None


# -- BF16 --------------------------------------------------------------------------------


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (uint16) to float32, exactly."""
    return (np.asarray(u16, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray, mode: str = "nearest") -> np.ndarray:
    """float32 to BF16 bit patterns: round to nearest even, or ``"up"`` in magnitude."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    if mode == "nearest":
        r = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
        return (r >> np.uint32(16)).astype(np.uint16)
    if mode == "up":
        hi = (u >> np.uint32(16)).astype(np.uint32)
        hi = hi + ((u & np.uint32(0xFFFF)) != 0).astype(np.uint32)
        return hi.astype(np.uint16)
    raise ValueError(mode)


def _tiles(data: np.ndarray, size: int) -> np.ndarray:
    a = np.asarray(data, dtype=np.uint8)
    if a.ndim == 1:
        if a.size % size:
            raise ValueError(f"{a.size} bytes is not a whole number of {size}-B tiles")
        a = a.reshape(-1, size)
    if a.shape[-1] != size:
        raise ValueError(f"tiles must be {size} bytes, got {a.shape[-1]}")
    return a.reshape(-1, size)


def _per_row_group(params_u16: np.ndarray) -> np.ndarray:
    """[N, 256] BF16 indexed g*32+lr -> float32 [N, 32 rows, 256 cols] broadcast per group."""
    p = bf16_to_f32(params_u16).reshape(-1, TILE_COLS // GROUP, TILE_ROWS)  # [N, g, lr]
    return np.repeat(p.transpose(0, 2, 1), GROUP, axis=2)  # [N, lr, cc]


# -- Q4NX ---------------------------------------------------------------------------------


def q4nx_codes(tiles: np.ndarray) -> np.ndarray:
    """Unsigned 4-bit codes as uint8 [N, 32, 256]."""
    t = _tiles(tiles, Q4NX_TILE)
    packed = t[:, 1024:].reshape(-1, 2, TILE_COLS, 8)  # [N, lr//16, cc, (lr%16)//2]
    lo = packed & 0x0F
    hi = packed >> 4
    q = np.stack([lo, hi], axis=-1)  # [N, h, cc, b, nib]; row = 16h + 2b + nib
    return q.transpose(0, 1, 3, 4, 2).reshape(-1, TILE_ROWS, TILE_COLS)


def q4nx_dequantize(tiles: np.ndarray) -> np.ndarray:
    """Q4NX tiles -> float32 [N, 32, 256]: ``(q - zp) * scale`` in float32."""
    t = _tiles(tiles, Q4NX_TILE)
    scale = _per_row_group(t[:, :512].copy().view("<u2"))
    zp = _per_row_group(t[:, 512:1024].copy().view("<u2"))
    q = q4nx_codes(t).astype(np.float32)
    return (q - zp) * scale


def q4nx_quantize(w: np.ndarray) -> np.ndarray:
    """float32 [N, 32, 256] -> Q4NX tiles uint8 [N, 5120] (asymmetric, per row and group)."""
    w = np.asarray(w, dtype=np.float32).reshape(-1, TILE_ROWS, TILE_COLS)
    n = w.shape[0]
    grp = w.reshape(n, TILE_ROWS, TILE_COLS // GROUP, GROUP)  # [N, lr, g, 32]
    lo = np.minimum(grp.min(axis=3), 0.0)
    hi = np.maximum(grp.max(axis=3), 0.0)
    span = (hi - lo) / np.float32(15.0)
    span = np.where(span > 0, span, np.float32(1.0)).astype(np.float32)
    scale_b = f32_to_bf16(span, "up")  # [N, lr, g]
    scale = bf16_to_f32(scale_b)
    zp_b = f32_to_bf16(np.clip(-lo / scale, 0.0, 15.0))
    zp = bf16_to_f32(zp_b)
    q = np.rint(grp / scale[..., None] + zp[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(n, TILE_ROWS, TILE_COLS)
    out = np.empty((n, Q4NX_TILE), dtype=np.uint8)
    out[:, :512] = scale_b.transpose(0, 2, 1).reshape(n, -1).view(np.uint8).reshape(n, 512)
    out[:, 512:1024] = zp_b.transpose(0, 2, 1).reshape(n, -1).view(np.uint8).reshape(n, 512)
    qq = q.reshape(n, 2, 8, 2, TILE_COLS)  # [N, h, b, nib, cc]
    packed = qq[:, :, :, 0, :] | (qq[:, :, :, 1, :] << 4)  # [N, h, b, cc]
    out[:, 1024:] = packed.transpose(0, 1, 3, 2).reshape(n, 4096)
    return out


# -- Q8_0 ---------------------------------------------------------------------------------


def q8_0_dequantize(tiles: np.ndarray) -> np.ndarray:
    """Q8_0 tiles -> float32 [N, 32, 256]: ``int8 * scale``."""
    t = _tiles(tiles, Q8_0_TILE)
    scale = _per_row_group(t[:, :512].copy().view("<u2"))
    q = t[:, 512:].view(np.int8).reshape(-1, TILE_ROWS, TILE_COLS).astype(np.float32)
    return q * scale


def q8_0_quantize(w: np.ndarray) -> np.ndarray:
    """float32 [N, 32, 256] -> Q8_0 tiles uint8 [N, 8704] (symmetric, per row and group)."""
    w = np.asarray(w, dtype=np.float32).reshape(-1, TILE_ROWS, TILE_COLS)
    n = w.shape[0]
    grp = w.reshape(n, TILE_ROWS, TILE_COLS // GROUP, GROUP)
    amax = np.abs(grp).max(axis=3) / np.float32(127.0)
    amax = np.where(amax > 0, amax, np.float32(1.0)).astype(np.float32)
    scale_b = f32_to_bf16(amax, "up")
    scale = bf16_to_f32(scale_b)
    q = np.clip(np.rint(grp / scale[..., None]), -127, 127).astype(np.int8)
    out = np.empty((n, Q8_0_TILE), dtype=np.uint8)
    out[:, :512] = scale_b.transpose(0, 2, 1).reshape(n, -1).view(np.uint8).reshape(n, 512)
    out[:, 512:] = q.reshape(n, 8192).view(np.uint8)
    return out


def scales(tiles: np.ndarray, tile_size: int) -> np.ndarray:
    """Per (row, group) scales as float32 [N, 32, 8] (for error bounds and inspection)."""
    t = _tiles(tiles, tile_size)
    return bf16_to_f32(t[:, :512].copy().view("<u2")).reshape(-1, 8, 32).transpose(0, 2, 1)


def dequantize(tiles: np.ndarray, tile_size: int) -> np.ndarray:
    """Dispatch on tile size: 5,120 -> Q4NX, 8,704 -> Q8_0."""
    if tile_size == Q4NX_TILE:
        return q4nx_dequantize(tiles)
    if tile_size == Q8_0_TILE:
        return q8_0_dequantize(tiles)
    raise ValueError(f"no codec for {tile_size}-B tiles")


def tiles_to_matrix(w: np.ndarray, a: int, h: int) -> np.ndarray:
    """[a*h, 32, 256] tiles of a ``[a, H, S]`` tensor -> the [a*32, H*256] matrix.

    Tile ``i*H + j`` covers rows ``32i..`` and columns ``256j..`` (the reported tile grid,
    ``n_tile_cols = in_features / 256``; not independently confirmed).
    """
    return w.reshape(a, h, TILE_ROWS, TILE_COLS).transpose(0, 2, 1, 3).reshape(a * 32, h * 256)
