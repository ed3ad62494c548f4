"""``seed-2026-09``: the seed write-up's model, "trim and interleave", exactly as it says.

Each 5,120-B tile is trimmed to ``tile[0:4736]`` and rows are interleaved in 16-row blocks,
``out[o] = trimmed[o//2 + 8(o%2)]`` (check vectors: row 0 == tile 0, row 1 == tile 8, row 2
== tile 1). Expert tensors sit at the seed's offsets 0x0 / 0x9400000 / 0x12800000.

Later notes refute the trim (the seed's check pre-trimmed the tiles before calling the
runtime; captures show consecutive windows). The seed also reports row 0 crossing the tensor
boundary (share_up's 824-B tail + up's first 3,912 B), which contradicts its own row-0 check;
``npu verify --locate`` finds such rows. The seed gives *offsets but no layout* for share_*,
qkv and gate_proj, nor any layout for the router tensors: those placements are assumptions,
marked ``unverified``.
"""

from __future__ import annotations

from ..codecs import WINDOW
from ..geometry import (
    ATTENTION_NORM_ROLES,
    ATTENTION_PROJ_ROLES,
    SHARED_EXPERT_ROLES,
    Geometry,
    LayerKind,
)
from ..orders import ab16, seed_k_pairs
from ..parts import NORMS_HEAD, ROUTER_ARG, raw, trimmed, weights_buffer
from ..profile import BufferSpec, LayerLayout, LayoutProfile, Provenance, Status

SEED = Provenance(
    Status.CLAIMED,
    "seed: runtime reorder_cpy on pre-trimmed tiles; rows 0,1,2 == tiles 0,8,1 [0:4736]",
    "later captures refute the trim (ref §6): the runtime takes consecutive 4,736-B windows",
)
SEED_FULL = Provenance(
    Status.INFERRED, "seed layout (described for layer 0)", "assumed on full layers"
)
ASSUMED_TRIM = Provenance(
    Status.UNVERIFIED,
    "seed: offset only",
    "layout assumed: trim + 16-row A/B interleave, since the seed says every tensor is "
    "dtype 8 (4,736-B elements)",
)
QKV = Provenance(
    Status.UNVERIFIED,
    "seed: offset 0x1bdbc000 only",
    "layout assumed (trim + A/B interleave); the seed's '2,304 x 5,120 tiles' would overlap "
    "gate_proj at 0x1c6fc000, the offsets imply 2,048 rows of 4,736 B",
)
GATE_PROJ = Provenance(
    Status.UNVERIFIED,
    "seed: offset 0x1c6fc000 and k-order '(a, a-7): [232, 225, 233, 226, ...]'",
    "the k-order read literally repeats tiles 232-736 and skips 0-224 and 744-1023, so it "
    "cannot be the whole order; ref §5 explains the list as the v1.0.x window sequence "
    "shifted by one",
)
SIZE = Provenance(
    Status.INFERRED,
    "end of gate_proj at the seed's offset + 1,024 rows",
    "equals v1.0.5's 465,567,744 + 3,456 x 4,736 = 481,935,360 B",
)
ROUTER_SEG = Provenance(
    Status.UNVERIFIED,
    "seed: shared_expert_gate at 0x2000",
    "the seed lists an 8 KiB read for a 4 KiB tensor",
)
ROUTER_MOE = Provenance(
    Status.UNVERIFIED,
    "seed: moe_router at 0x3000 (12 KiB read)",
    "no layout given: copied as stored",
)
ROUTER_SIZE = Provenance(Status.INFERRED, "0x3000 + the router tensor")


def build(geo: Geometry, kind: LayerKind) -> LayerLayout:
    up = geo.shape("up_exps").n_tiles
    prov = SEED if kind == LayerKind.LINEAR else SEED_FULL
    rule = "trimmed[o//2 + 8(o%2)] per 16-row block (75,776 B)"
    places = [
        trimmed(
            "weights", i * up * WINDOW, role, geo, ab16(geo.shape(role).n_tiles), rule, prov, "A"
        )
        for i, role in enumerate(("up_exps", "gate_exps", "down_exps"))
    ]
    unplaced = {
        "input_layernorm": "the seed gives no offset for the layer norms",
        "post_attention_layernorm": "the seed gives no offset for the layer norms",
    }
    if kind == LayerKind.LINEAR:
        at = 3 * up
        for role in ("share_up", "share_gate", "share_down", "qkv"):
            n = geo.shape(role).n_tiles
            p = QKV if role == "qkv" else ASSUMED_TRIM
            places.append(trimmed("weights", at * WINDOW, role, geo, ab16(n), rule, p, "B"))
            at += n
        n = geo.shape("gate_proj").n_tiles
        places.append(
            trimmed(
                "weights",
                at * WINDOW,
                "gate_proj",
                geo,
                seed_k_pairs(n),
                "trimmed tiles (a, a-7) for a = 232, 233, ...",
                GATE_PROJ,
                "B",
            )
        )
        size = (at + n) * WINDOW
        size_prov = SIZE
        for role in (*NORMS_HEAD, "ssm_out"):
            unplaced[role] = "the seed describes no norms buffer"
    else:
        size = 3 * up * WINDOW
        size_prov = Provenance(Status.INFERRED, "the expert tensors only")
        for role in SHARED_EXPERT_ROLES + ATTENTION_PROJ_ROLES + ATTENTION_NORM_ROLES:
            unplaced[role] = "the seed describes layer 0 (linear) only"
    weights = weights_buffer(
        size,
        places,
        size_prov,
        "trimmed 4,736-B rows in 16-row A/B blocks",
    )
    h, e = geo.hidden, geo.n_experts
    router = BufferSpec(
        "router",
        0x3000 + h * e * 2,
        ROUTER_ARG,
        (
            raw("router", 0x2000, "shared_expert_gate", geo, ROUTER_SEG),
            raw("router", 0x3000, "moe_router", geo, ROUTER_MOE),
        ),
        ROUTER_SIZE,
        description="seed offsets only",
    )
    return LayerLayout(kind, (weights, router), unplaced)


PLUGIN = LayoutProfile(
    name="seed-2026-09",
    runtime="the seed write-up's model (no runtime version)",
    summary="trim tiles to 4,736 B + 16-row A/B interleave; refuted by later captures",
    provenance=Provenance(Status.CLAIMED, "seeds/npu-35b-moe-packing.txt", "refuted by ref §5-6"),
    build=build,
)
