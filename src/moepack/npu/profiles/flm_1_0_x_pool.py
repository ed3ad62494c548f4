"""``flm-1.0.x-pool`` (alias ``flm-1.0.x``): FastFlowLM 1.0.x as one capture shows it.

The runtime reads the file in raw 4,736-B windows ``W(x, j) = x[4736j : 4736(j+1)]`` (no
trimming, no requantisation), which do not line up with the 5,120-B tiles; the notes report
NaNs. This variant follows the *expert-pool* capture (reference §5, layer 6, byte-verified in
the notes). The v1.0.5 region-B finding contradicts it (the pool runs past row 98,304, where
that finding puts region B); it is the separate profile ``flm-1.0.5-regionb``.
"""

from __future__ import annotations

from ..codecs import WINDOW
from ..geometry import ATTENTION_PROJ_ROLES, SHARED_EXPERT_ROLES, Geometry, LayerKind
from ..orders import block32_rows, groups8, ssm_out_105, wrapped_ab
from ..parts import (
    NORMS_ARG,
    RunLayout,
    attn_norms_buffer,
    norms_head,
    router_buffer,
    weights_buffer,
    whole_windows,
    windows,
)
from ..profile import BufferSpec, LayerLayout, LayoutProfile, Provenance, Status, ZeroFill
from .flm_0_9_46 import build as build_0946

CAPTURE = Provenance(Status.VERIFIED, "ref §5: v1.0.x capture, layer 6, byte-verified in the notes")
CAPTURE_FULL = Provenance(
    Status.INFERRED, "ref §5: v1.0.x capture (a linear layer)", "assumed the same on full layers"
)
ZERO = Provenance(Status.REPORTED, "ref §5: everything after row 102,623 is zero")
SIZE = Provenance(
    Status.INFERRED,
    "the 0.9.46 weight allocation (0x1FCB0000)",
    "the capture's length is not reported; it only must exceed 486,027,264 B",
)
NORMS = Provenance(Status.REPORTED, "ref §5: second per-layer buffer (5 MB)", "no byte oracle")
SAME_AS_0946 = Provenance(
    Status.INFERRED, "assumed unchanged from flm-0.9.46", "not captured for v1.0.x"
)
NORMS_SIZE = 5 * 1024 * 1024
GATE_PROJ_START, GATE_PROJ_MOD, GATE_PROJ_BLOCKS = 224, 1880, 104


def pool(geo: Geometry, prov: Provenance, down_rows: int | None = None) -> tuple[list, int]:
    """Rows 0..: alternating 32-row blocks (up b, gate b), then down windows in groups of 8."""
    up = geo.shape("up_exps").n_tiles
    rows = block32_rows(up // 32)
    rule = "W(x, 32b + 8(i%4) + i//4), 32-row blocks alternating up/gate"
    run = RunLayout(run=32, gap=32 * WINDOW, region="A: expert pool")
    n_down = whole_windows(geo, "down_exps") if down_rows is None else down_rows
    places = [
        windows("weights", 0, "up_exps", rows, rule, prov, **run),
        windows("weights", 32 * WINDOW, "gate_exps", rows, rule, prov, **run),
        windows(
            "weights",
            2 * up * WINDOW,
            "down_exps",
            groups8(n_down),
            "W(down, 8g + [0,2,4,6,1,3,5,7][i])",
            prov,
            region="A: expert pool",
        ),
    ]
    return places, 2 * up + n_down


def norms_buffer(geo: Geometry) -> BufferSpec:
    head, head_end = norms_head("norms", geo, NORMS)
    n_rows = -(-(NORMS_SIZE - head_end) // WINDOW)
    ssm_out = windows(
        "norms",
        head_end,
        "ssm_out",
        ssm_out_105(n_rows),
        "W(ssm_out, 32b + 16(i%2) + i//2) until 5,242,880 B are full",
        NORMS,
        length=NORMS_SIZE - head_end,
        region="ssm_out",
    )
    return BufferSpec(
        "norms",
        NORMS_SIZE,
        NORMS_ARG,
        tuple(head + [ssm_out]),
        NORMS,
        description="SSM parameters (plain) + ssm_out windows",
    )


def weights_size(geo: Geometry, kind: LayerKind) -> int:
    return build_0946(geo, kind).buffer("weights").size


def build(geo: Geometry, kind: LayerKind) -> LayerLayout:
    size = weights_size(geo, kind)
    if kind == LayerKind.LINEAR:
        places, rows = pool(geo, CAPTURE)
        places.append(
            windows(
                "weights",
                rows * WINDOW,
                "gate_proj",
                wrapped_ab(GATE_PROJ_START, GATE_PROJ_MOD, GATE_PROJ_BLOCKS),
                "W(gate_proj, v), W(v + 8 mod 1880), v from 224: windows {0..7} u {224..1879}",
                CAPTURE,
                region="A: expert pool",
            )
        )
        end = (rows + 16 * GATE_PROJ_BLOCKS) * WINDOW
        weights = weights_buffer(
            size,
            places,
            SIZE,
            "4,736-B window rows; zero after the pool",
            zero=(ZeroFill(end, size - end, ZERO, "zero after the pool"),),
        )
        return LayerLayout(
            kind,
            (weights, router_buffer(geo, SAME_AS_0946, SAME_AS_0946), norms_buffer(geo)),
            unplaced={
                r: "the v1.0.x pool capture shows no rows for it"
                for r in (*SHARED_EXPERT_ROLES, "qkv")
            },
        )
    places, rows = pool(geo, CAPTURE_FULL)
    weights = weights_buffer(
        size,
        places,
        SIZE,
        "4,736-B window rows (expert pool only; attention not captured)",
    )
    return pool_only_full_layer(geo, weights, "not captured for v1.0.x full-attention layers")


FULL_LAYER_UNDESCRIBED = SHARED_EXPERT_ROLES + ATTENTION_PROJ_ROLES


def pool_only_full_layer(geo: Geometry, weights: BufferSpec, why: str) -> LayerLayout:
    """A full-attention layer of which only the expert pool is known (both v1.0.x findings):
    the weights buffer, router and attention norms as in 0.9.46, and the attention and
    shared-expert tensors listed as unplaced with ``why``."""
    return LayerLayout(
        LayerKind.FULL,
        (
            weights,
            router_buffer(geo, SAME_AS_0946, SAME_AS_0946),
            attn_norms_buffer(geo, SAME_AS_0946),
        ),
        unplaced={r: why for r in FULL_LAYER_UNDESCRIBED},
    )


PLUGIN = LayoutProfile(
    name="flm-1.0.x-pool",
    runtime="FastFlowLM 1.0.x (expert-pool capture)",
    summary="raw 4,736-B windows; the pool capture of layer 6 (conflicts with flm-1.0.5-regionb)",
    provenance=Provenance(Status.VERIFIED, "ref §5 pool capture", "the runtime produced NaNs"),
    build=build,
    aliases=("flm-1.0.x",),
)
