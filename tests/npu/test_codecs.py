"""Tile codecs: bit-exact against the scalar formulas, byte positions, quantisation bounds."""

from __future__ import annotations

import numpy as np
import pytest

from moepack.npu import codecs, codecs_ref
from moepack.npu.synth import q4nx_tiles, q8_0_tiles


def test_q4nx_bit_exact_against_scalar_reference():
    rng = np.random.default_rng(1)
    tiles = q4nx_tiles(rng, 2)
    tiles[1, 512:1024] = codecs.f32_to_bf16(rng.uniform(0, 15, 256).astype(np.float32)).view(
        np.uint8
    )
    fast = codecs.q4nx_dequantize(tiles)
    for i in range(2):
        ref = codecs_ref.dequantize_tile(bytes(tiles[i]), "q4nx")
        assert np.array_equal(fast[i].view(np.uint32), ref.view(np.uint32))


def test_q8_0_bit_exact_against_scalar_reference():
    tiles = q8_0_tiles(np.random.default_rng(2), 2)
    fast = codecs.q8_0_dequantize(tiles)
    for i in range(2):
        ref = codecs_ref.dequantize_tile(bytes(tiles[i]), "q8_0")
        assert np.array_equal(fast[i].view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize(
    "lr, cc", [(0, 0), (1, 0), (15, 255), (16, 3), (17, 40), (31, 255), (6, 100)]
)
def test_q4nx_byte_positions(lr, cc):
    """One code planted at the documented byte/nibble shows up at exactly (lr, cc)."""
    tile = np.zeros(codecs.Q4NX_TILE, np.uint8)
    g = cc // 32
    tile[:512].view("<u2")[g * 32 + lr] = codecs.f32_to_bf16(np.array([0.5], np.float32))[0]
    tile[512:1024].view("<u2")[g * 32 + lr] = codecs.f32_to_bf16(np.array([3.0], np.float32))[0]
    byte = 1024 + (lr // 16) * 2048 + cc * 8 + (lr % 16) // 2
    tile[byte] = 11 if lr % 2 == 0 else 11 << 4
    w = codecs.q4nx_dequantize(tile)[0]
    want = np.zeros((32, 256), np.float32)
    want[lr, g * 32 : g * 32 + 32] = (0 - 3.0) * 0.5
    want[lr, cc] = (11 - 3.0) * 0.5  # (q - zp) * scale, not the retracted q*scale + zp
    assert np.array_equal(w, want)
    codes = codecs.q4nx_codes(tile)[0]
    assert codes[lr, cc] == 11 and codes.sum() == 11


def test_q8_0_positions_and_no_zero_point():
    tile = np.zeros(codecs.Q8_0_TILE, np.uint8)
    tile[:512].view("<u2")[(77 // 32) * 32 + 5] = codecs.f32_to_bf16(np.array([0.25], np.float32))[
        0
    ]
    tile[512 + 5 * 256 + 77] = np.uint8(256 - 8)  # int8 -8
    w = codecs.q8_0_dequantize(tile)[0]
    assert w[5, 77] == -2.0 and np.count_nonzero(w) == 1


def test_quantise_error_bounds():
    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.05, size=(6, 32, 256)).astype(np.float32)
    w[0, 3, :32] = 0.0  # a constant group
    for quant, size in (
        (codecs.q4nx_quantize, codecs.Q4NX_TILE),
        (codecs.q8_0_quantize, codecs.Q8_0_TILE),
    ):
        tiles = quant(w)
        back = codecs.dequantize(tiles, size)
        scale = np.repeat(codecs.scales(tiles, size), 32, axis=2)
        assert np.all(np.abs(back - w) <= 0.5 * scale * (1 + 1e-5) + 1e-12)
        assert np.all(back[0, 3, :32] == 0.0)


def test_runtime_element_size_oracle():
    """Reference §2 lists the oracle's output for dtypes 0-5; dtype 8's 4,736 B is the
    argument reorder_cpy is called with, a separate fact (not an oracle output)."""
    sizes = {d: codecs.get_quantization_byte_size(8192, d) for d in range(6)}
    assert sizes == {0: 4608, 1: 8704, 2: 5120, 3: 9216, 4: 5120, 5: 9216}
    assert sizes[1] == codecs.Q8_0_TILE and sizes[2] == sizes[4] == codecs.Q4NX_TILE
    for dtype in (6, 8):
        with pytest.raises(ValueError, match=f"dtype {dtype} was not observed"):
            codecs.get_quantization_byte_size(8192, dtype)
    with pytest.raises(ValueError, match="only observed for 8,192 weights"):
        codecs.get_quantization_byte_size(4096, 1)
    assert (codecs.REORDER_CPY_DTYPE, codecs.REORDER_CPY_ELEMENT_SIZE) == (8, 4736)
    assert codecs.WINDOW == 4736


def test_matrix_assembly_follows_tile_grid():
    w = np.arange(2 * 3 * 32 * 256, dtype=np.float32).reshape(6, 32, 256)
    m = codecs.tiles_to_matrix(w, 2, 3)
    assert m.shape == (64, 768)
    assert m[32 + 5, 256 * 2 + 7] == w[1 * 3 + 2, 5, 7]
