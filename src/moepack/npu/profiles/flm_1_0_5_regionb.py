"""``flm-1.0.5-regionb``: FastFlowLM 1.0.5 as its region-B finding describes it.

Region B at 0x1BC00000 (= 98,304 x 4,736): share_up, share_gate, share_down, qkv, gate_proj
as 4,736-B window rows reordered by ``out[2H*blk + i] = in[2H*blk + i//2 + H(i%2)]`` with
``H = n / 256`` (share_* come out unchanged); the permutation was verified against the
runtime's own reorder function (qkv 2048/2048, gate_proj 1024/1024). Buffer 481,935,360 B.

The finding says nothing about region A; to fit region B's offset it must hold 98,304 rows,
so this profile uses the pool capture's up/gate order and only the first 32,768 down windows
(inferred). It conflicts with ``flm-1.0.x-pool`` (reference §5, unresolved).
"""

from __future__ import annotations

from ..codecs import WINDOW
from ..geometry import Geometry, LayerKind
from ..orders import reorder_105
from ..parts import router_buffer, weights_buffer, windows
from ..profile import LayerLayout, LayoutProfile, Provenance, Status
from .flm_1_0_x_pool import SAME_AS_0946, norms_buffer, pool, pool_only_full_layer

REGION_A = Provenance(
    Status.INFERRED,
    "pool order from the v1.0.x capture (ref §5)",
    "region A is not part of the v1.0.5 finding; down truncated to 32,768 windows so region B "
    "starts at 98,304 x 4,736",
)
REGION_B = Provenance(
    Status.REPORTED,
    "ref §5: v1.0.5 region B at 0x1BC00000",
    "the permutation itself was verified against the runtime's reorder function "
    "(qkv 2048/2048, gate_proj 1024/1024); window units and offsets are from the same notes",
)
SIZE = Provenance(Status.REPORTED, "ref §5: 465,567,744 + 3,456 x 4,736 = 481,935,360 B")
REGION_B_ROLES = ("share_up", "share_gate", "share_down", "qkv", "gate_proj")


def build(geo: Geometry, kind: LayerKind) -> LayerLayout:
    up = geo.shape("up_exps").n_tiles
    places, rows = pool(geo, REGION_A, down_rows=geo.shape("down_exps").n_tiles)
    at = rows
    if kind == LayerKind.LINEAR:
        for role in REGION_B_ROLES:
            n = geo.shape(role).n_tiles
            h = n // 256
            rule = (
                "identity (H = n/256 = 0)"
                if h == 0
                else f"out[2H*blk+i] = W(in, 2H*blk + i//2 + H(i%2)), H = {h}"
            )
            places.append(
                windows("weights", at * WINDOW, role, reorder_105(n), rule, REGION_B, region="B")
            )
            at += n
        weights = weights_buffer(
            at * WINDOW,
            places,
            SIZE,
            "4,736-B window rows: region A (98,304 rows) + region B",
        )
        return LayerLayout(
            kind, (weights, router_buffer(geo, SAME_AS_0946, SAME_AS_0946), norms_buffer(geo))
        )
    size = (3 * up + sum(geo.shape(r).n_tiles for r in REGION_B_ROLES)) * WINDOW
    weights = weights_buffer(
        size,
        places,
        Provenance(Status.INFERRED, "same size as a linear layer's buffer"),
        "4,736-B window rows: region A only (region B of full layers not described)",
    )
    return pool_only_full_layer(
        geo, weights, "the v1.0.5 finding covers linear layers' region B only"
    )


PLUGIN = LayoutProfile(
    name="flm-1.0.5-regionb",
    runtime="FastFlowLM 1.0.5 (region-B finding)",
    summary="raw 4,736-B windows; region B at 0x1BC00000 (conflicts with flm-1.0.x-pool)",
    provenance=Provenance(Status.REPORTED, "ref §5 v1.0.5 region B", "the runtime produced NaNs"),
    build=build,
)
