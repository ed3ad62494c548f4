"""``flm-0.9.46``: FastFlowLM 0.9.46, the only runtime reported to run the 35B.

Byte-verified against a vendor dump (reference §4): expert pool 503,316,480 / 503,316,480 B
and region B 30,081,024 / 30,081,024 B with 0 mismatches. Tiles are emitted in pairs whose
512-B chunks interleave (``out[1024c + 512s + t] = tile_s[512c + t]``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..codecs import Q4NX_TILE, Q8_0_TILE
from ..geometry import Geometry, LayerKind
from ..orders import block16_down, block32_rows, pair_blocks
from ..parts import (
    NORMS_ARG,
    RunLayout,
    attn_norms_buffer,
    norms_head,
    router_buffer,
    tiles,
    weights_buffer,
)
from ..profile import BufferSpec, LayerLayout, LayoutProfile, Provenance, Status

ORDER = 0  # the default profile, listed first
POOL = Provenance(Status.VERIFIED, "ref §4: vendor dump, expert pool 503,316,480/503,316,480 B")
REGION_B = Provenance(Status.VERIFIED, "ref §4: vendor dump, region B 30,081,024/30,081,024 B")
REGION_B_FULL = Provenance(
    Status.REPORTED, "ref §4: full-attention tile offsets", "listed in the notes, not byte-checked"
)
POOL_FULL = Provenance(
    Status.INFERRED, "ref §4: pool formula", "verified on a linear layer; same formula assumed"
)
SIZE = Provenance(Status.VERIFIED, "ref §4: 0x1FCB0000 weight buffer")
SIZE_FULL = Provenance(Status.INFERRED, "ref §4: pool + 3,712 Q8_0 tiles (total inferred)")
NORMS = Provenance(Status.REPORTED, "ref §4: derived from the read pattern", "no byte oracle")
ATTN = Provenance(Status.VERIFIED, "ref §4: byte-exact against a vendor dump")
ROUTER = Provenance(
    Status.REPORTED,
    "ref §4: router buffer",
    "best effort: validated by reproducing reference top-8 experts, not byte-checked",
)

# Region B, linear layer: (role, H) in buffer order.
REGION_B_LINEAR = (
    ("share_up", 8),
    ("share_gate", 8),
    ("share_down", 2),
    ("qkv", 8),
    ("gate_proj", 8),
)


def expert_pool(geo: Geometry, prov: Provenance) -> tuple[list, int]:
    """Region A: per block b, 16 pairs of up tiles then the same 16 of gate; then down."""
    up = geo.shape("up_exps").n_tiles
    down = geo.shape("down_exps").n_tiles
    rows = block32_rows(up // 32)
    rule = "r_i = 32b + 8(i%4) + i//4; pairs (r_2p, r_2p+1)"
    run = RunLayout(run=32, gap=32 * Q4NX_TILE, region="A: expert pool")
    places = [
        tiles("weights", 0, "up_exps", geo, rows, rule, prov, **run),
        tiles("weights", 32 * Q4NX_TILE, "gate_exps", geo, rows, rule, prov, **run),
        tiles(
            "weights",
            2 * up * Q4NX_TILE,
            "down_exps",
            geo,
            block16_down(down // 16),
            "d_i = 16b + 8(i//8) + [0,2,4,6,1,3,5,7][i%8]; pairs (d_2p, d_2p+1)",
            prov,
            region="A: expert pool",
        ),
    ]
    return places, (2 * up + down) * Q4NX_TILE


RegionBItem = tuple[str, int, int, int, int]
"""One Q8_0 tensor of region B: (role, first tile, tiles, H, tile offset in the region)."""


def region_b(
    geo: Geometry, base: int, items: Sequence[RegionBItem], prov: Provenance
) -> tuple[list, int]:
    """Q8_0 tensors as H-pairs; ``items`` = (role, tile_from, n_tiles, H, tile_offset)."""
    places = []
    end = 0
    for role, first, n, h, at in items:
        order = pair_blocks(n, h, base=first)
        rule = f"per 2H block: (2H*blk + j, 2H*blk + j + H), H = {h}"
        if first:
            rule += f", tiles {first}..{first + n - 1}"
        places.append(
            tiles("weights", base + at * Q8_0_TILE, role, geo, order, rule, prov, region="B")
        )
        end = max(end, at + n)
    return places, end * Q8_0_TILE


def pool_and_region_b(
    geo: Geometry,
    pool_prov: Provenance,
    items: Sequence[RegionBItem],
    region_b_prov: Provenance,
    size_prov: Provenance,
) -> BufferSpec:
    """The weights buffer: the expert pool (region A), then ``items`` as region B behind it."""
    pool, pool_size = expert_pool(geo, pool_prov)
    rb, rb_size = region_b(geo, pool_size, items, region_b_prov)
    return weights_buffer(
        pool_size + rb_size,
        pool + rb,
        size_prov,
        "expert pool (region A) + shared experts and attention (region B)",
    )


def build(geo: Geometry, kind: LayerKind) -> LayerLayout:
    if kind == LayerKind.LINEAR:
        items, at = [], 0
        for role, h in REGION_B_LINEAR:
            n = geo.shape(role).n_tiles
            items.append((role, 0, n, h, at))
            at += n
        weights = pool_and_region_b(geo, POOL, items, REGION_B, SIZE)
        head, head_end = norms_head("norms", geo, NORMS)
        n_out = geo.shape("ssm_out").n_tiles
        ssm_out = tiles(
            "norms",
            head_end,
            "ssm_out",
            geo,
            pair_blocks(n_out, 16),
            "per 2H block: (2H*blk + j, 2H*blk + j + H), H = 16",
            NORMS,
            region="ssm_out",
        )
        norms = BufferSpec(
            "norms",
            head_end + n_out * Q8_0_TILE,
            NORMS_ARG,
            tuple(head + [ssm_out]),
            NORMS,
            description="SSM parameters (plain) + ssm_out as H = 16 pairs",
        )
        buffers = (weights, router_buffer(geo, ROUTER, ROUTER), norms)
        return LayerLayout(kind, buffers)
    s = geo.shape
    nq = s("q_proj").n_tiles
    half = nq // 2
    n_su, n_sg, n_sd = s("share_up").n_tiles, s("share_gate").n_tiles, s("share_down").n_tiles
    n_k, n_v = s("k_proj").n_tiles, s("v_proj").n_tiles
    at_q0 = n_su + n_sg + n_sd  # 384
    items = [
        ("share_up", 0, n_su, 8, 0),
        ("share_gate", 0, n_sg, 8, n_su),
        ("share_down", 0, n_sd, 2, n_su + n_sg),
        ("q_proj", 0, half, 8, at_q0),  # 384
        ("k_proj", 0, n_k, 8, at_q0 + half),  # 1408
        ("v_proj", 0, n_v, 8, at_q0 + half + n_k),  # 1536
        ("q_proj", half, half, 8, at_q0 + half + n_k + n_v),  # 1664
        ("o_proj", 0, s("o_proj").n_tiles, 16, at_q0 + nq + n_k + n_v),  # 2688
    ]
    weights = pool_and_region_b(geo, POOL_FULL, items, REGION_B_FULL, SIZE_FULL)
    return LayerLayout(
        kind, (weights, router_buffer(geo, ROUTER, ROUTER), attn_norms_buffer(geo, ATTN))
    )


PLUGIN = LayoutProfile(
    name="flm-0.9.46",
    runtime="FastFlowLM 0.9.46",
    summary="byte-verified against a vendor dump; 512-B chunk pairs; the recommended default",
    provenance=Provenance(Status.VERIFIED, "ref §4"),
    build=build,
)
