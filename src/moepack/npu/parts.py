"""Building blocks several profiles share (so each profile file reads like its notes)."""

from __future__ import annotations

from typing import TypedDict

import numpy as np

from . import orders
from .codecs import Q4NX_TILE, Q8_0_TILE, WINDOW
from .geometry import Geometry
from .profile import BufferSpec, Placement, Provenance, ZeroFill


class RunLayout(TypedDict):
    """Keywords shared by the placements of one region laid out in runs: units per run, bytes
    between the starts of runs, and the region's label."""

    run: int
    gap: int
    region: str


ROUTER_ARG = 2
NORMS_ARG = 3
WEIGHTS_ARG = 0
# The 328,192-B norms head (reference §4), in buffer order.
NORMS_HEAD = ("ssm_conv1d", "ssm_norm", "ssm_a", "ssm_dt_bias", "ssm_alpha", "ssm_beta")


def raw(
    buffer: str, offset: int, role: str, geo: Geometry, prov: Provenance, region: str = ""
) -> Placement:
    """A whole tensor copied as is."""
    n = geo.shape(role).nbytes
    return Placement(
        buffer, offset, role, "bytes", n, n, np.zeros(1, np.int64), "as stored", prov, region=region
    )


def tiles(
    buffer: str,
    offset: int,
    role: str,
    geo: Geometry,
    order: np.ndarray,
    rule: str,
    prov: Provenance,
    *,
    scheme: str = "pair512",
    run: int = 0,
    gap: int = 0,
    region: str = "",
) -> Placement:
    size = geo.shape(role).tile_size or Q8_0_TILE
    return Placement(
        buffer,
        offset,
        role,
        "tile",
        size,
        size,
        order,
        rule,
        prov,
        scheme=scheme,
        run=run,
        gap=gap,
        region=region,
    )


def windows(
    buffer: str,
    offset: int,
    role: str,
    order: np.ndarray,
    rule: str,
    prov: Provenance,
    *,
    run: int = 0,
    gap: int = 0,
    length: int | None = None,
    region: str = "",
) -> Placement:
    return Placement(
        buffer,
        offset,
        role,
        "window",
        WINDOW,
        WINDOW,
        order,
        rule,
        prov,
        run=run,
        gap=gap,
        length=length,
        region=region,
    )


def trimmed(
    buffer: str,
    offset: int,
    role: str,
    geo: Geometry,
    order: np.ndarray,
    rule: str,
    prov: Provenance,
    region: str = "",
) -> Placement:
    pitch = geo.shape(role).tile_size or Q4NX_TILE
    return Placement(buffer, offset, role, "trim", WINDOW, pitch, order, rule, prov, region=region)


def weights_buffer(
    size: int,
    places: list[Placement] | tuple[Placement, ...],
    size_prov: Provenance,
    description: str,
    zero: tuple[ZeroFill, ...] = (),
) -> BufferSpec:
    """The layer's weights buffer (argument 0): every profile has one, each fills it its way."""
    return BufferSpec(
        "weights", size, WEIGHTS_ARG, tuple(places), size_prov, zero=zero, description=description
    )


def whole_windows(geo: Geometry, role: str) -> int:
    """How many whole 4,736-B windows a tensor holds (35,424 for a 35B expert tensor)."""
    return geo.shape(role).nbytes // WINDOW


def router_buffer(geo: Geometry, prov: Provenance, size_prov: Provenance) -> BufferSpec:
    """Router buffer (argument 2): norms at 0 and 0x1000, shared_expert_gate at 0x2000,
    moe_router at 0x3000 transposed so experts are the outer index."""
    h, e = geo.hidden, geo.n_experts
    places = (
        raw("router", 0x0000, "input_layernorm", geo, prov),
        raw("router", 0x1000, "post_attention_layernorm", geo, prov),
        raw("router", 0x2000, "shared_expert_gate", geo, prov),
        Placement(
            "router",
            0x3000,
            "moe_router",
            "element",
            2,
            2,
            orders.transpose(h, e),
            f"dst[e*{h} + h] = router[h][e] (transpose [{h},{e}] -> [{e},{h}])",
            prov,
        ),
    )
    return BufferSpec(
        "router",
        0x3000 + h * e * 2,
        ROUTER_ARG,
        places,
        size_prov,
        description="router + shared-expert gate + layer norms",
    )


def attn_norms_buffer(geo: Geometry, prov: Provenance) -> BufferSpec:
    """Full-attention norms: 128 zero bytes, q_norm at 128, k_norm at 640 (1,152 B)."""
    q = geo.shape("q_norm").nbytes
    places = (
        raw("attn_norms", 128, "q_norm", geo, prov),
        raw("attn_norms", 128 + q, "k_norm", geo, prov),
    )
    size = 128 + q + geo.shape("k_norm").nbytes
    return BufferSpec(
        "attn_norms",
        size,
        None,
        places,
        prov,
        zero=(ZeroFill(0, 128, prov, "leading zeros"),),
        description="full-attention q/k norms",
    )


def norms_head(buffer: str, geo: Geometry, prov: Provenance) -> tuple[list[Placement], int]:
    """The SSM tensors concatenated as stored; returns the placements and their end."""
    out, off = [], 0
    for role in NORMS_HEAD:
        out.append(raw(buffer, off, role, geo, prov, region="head"))
        off += geo.shape(role).nbytes
    return out, off
