"""Every size, offset and check vector in the reference, against the profiles.

Orders are re-derived here with plain loops written from the reference's words, so a slip in
the vectorised formulas (``orders.py``) cannot hide behind itself.
"""

from __future__ import annotations

import numpy as np
import pytest

from moepack.errors import BadInput
from moepack.npu.bufmap import build_map, virtual_refs
from moepack.npu.geometry import Geometry, LayerKind
from moepack.npu.plan import compile_layer
from moepack.npu.profile import Status
from moepack.npu.profiles import all_profiles, get_profile

FULL = Geometry.full()
LIN, ATT = LayerKind.LINEAR, LayerKind.FULL


def place(profile: str, kind: LayerKind, buffer: str, role: str, nth: int = 0, geo=FULL):
    found = [
        p
        for p in get_profile(profile).layout(geo, kind).buffer(buffer).placements
        if p.role == role
    ]
    return found[nth]


def test_registry_and_unknown_profile():
    names = [p.name for p in all_profiles()]
    assert names[0] == "flm-0.9.46"
    assert set(names) == {"flm-0.9.46", "flm-1.0.x-pool", "flm-1.0.5-regionb", "seed-2026-09"}
    assert get_profile(None).name == "flm-0.9.46"
    assert get_profile("flm-1.0.x").name == "flm-1.0.x-pool"
    with pytest.raises(BadInput, match="unknown profile 'flm-2'; known: flm-0.9.46"):
        get_profile("flm-2")


# -- flm-0.9.46 ------------------------------------------------------------------------------


def test_0946_sizes():
    lay = get_profile("flm-0.9.46").layout(FULL, LIN)
    w = lay.buffer("weights")
    assert w.size == 0x1FCB0000 == 533_397_504
    down = place("flm-0.9.46", LIN, "weights", "down_exps")
    share_up = place("flm-0.9.46", LIN, "weights", "share_up")
    assert down.offset + down.nbytes == share_up.offset == 0x1E000000 == 98_304 * 5120
    region_b = [p for p in w.placements if p.region == "B"]
    assert sum(p.nbytes for p in region_b) == 30_081_024 == 3456 * 8704
    assert lay.buffer("norms").size == 9_241_088
    assert place("flm-0.9.46", LIN, "norms", "ssm_out").offset == 328_192
    assert lay.buffer("router").size == 0x3000 + 1024 * 1024
    full = get_profile("flm-0.9.46").layout(FULL, ATT)
    assert full.buffer("weights").size - 0x1E000000 == 32_309_248 == 3712 * 8704
    assert full.buffer("attn_norms").size == 1152


def test_0946_pool_formula_literally():
    up = place("flm-0.9.46", LIN, "weights", "up_exps")
    gate = place("flm-0.9.46", LIN, "weights", "gate_exps")
    down = place("flm-0.9.46", LIN, "weights", "down_exps")
    # For block b: r_i = 32b + 8(i%4) + i//4; emit pairs (r_2p, r_2p+1) from up, then gate.
    emitted = []  # (buffer tile slot, tensor, tile)
    slot = 0
    for b in range(1024):
        r = [32 * b + 8 * (i % 4) + i // 4 for i in range(32)]
        for tensor in ("up", "gate"):
            for p in range(16):
                emitted += [(slot, tensor, r[2 * p]), (slot + 1, tensor, r[2 * p + 1])]
                slot += 2
    for b in range(2048):
        d = [16 * b + 8 * (i // 8) + [0, 2, 4, 6, 1, 3, 5, 7][i % 8] for i in range(16)]
        for p in range(8):
            emitted += [(slot, "down", d[2 * p]), (slot + 1, "down", d[2 * p + 1])]
            slot += 2
    assert slot == 98_304
    got = {}
    for name, pl in (("up", up), ("gate", gate), ("down", down)):
        for off, tile in zip(pl.dst_offsets().tolist(), pl.order.tolist(), strict=True):
            got[off // 5120] = (name, tile)
    assert all(got[s] == (t, i) for s, t, i in emitted)
    assert all(p.scheme == "pair512" for p in (up, gate, down))


def test_0946_region_b_pairs_literally():
    """Region B from 0x1E000000: per tensor, per block of 2H tiles, pairs
    (2H*blk + j, 2H*blk + j + H) for j < H, each tile one 8,704-B slot."""
    w = get_profile("flm-0.9.46").layout(FULL, LIN).buffer("weights")
    want = {}  # region B tile slot -> (tensor, tile)
    slot = 0
    for role, h in (("share_up", 8), ("share_gate", 8), ("share_down", 2), ("qkv", 8),
                    ("gate_proj", 8)):  # fmt: skip
        n = FULL.shape(role).n_tiles
        for blk in range(n // (2 * h)):
            for j in range(h):
                want[slot] = (role, 2 * h * blk + j)
                want[slot + 1] = (role, 2 * h * blk + j + h)
                slot += 2
    assert slot == 3456
    got = {}
    for p in w.placements:
        if p.region == "B":
            assert p.scheme == "pair512" and p.unit_size == 8704
            for off, tile in zip(p.dst_offsets().tolist(), p.order.tolist(), strict=True):
                rel, rest = divmod(off - 0x1E000000, 8704)
                assert rest == 0 and rel not in got
                got[rel] = (p.role, tile)
    assert got == want


def test_0946_full_attention_tile_offsets():
    rb = [
        p
        for p in get_profile("flm-0.9.46").layout(FULL, ATT).buffer("weights").placements
        if p.region == "B"
    ]
    at = [((p.offset - 0x1E000000) // 8704, p.role, int(p.order.min()), p.count) for p in rb]
    assert at == [
        (0, "share_up", 0, 128), (128, "share_gate", 0, 128), (256, "share_down", 0, 128),
        (384, "q_proj", 0, 1024), (1408, "k_proj", 0, 128), (1536, "v_proj", 0, 128),
        (1664, "q_proj", 1024, 1024), (2688, "o_proj", 0, 1024),
    ]  # fmt: skip
    o = rb[-1]
    assert o.order[:4].tolist() == [0, 16, 1, 17]  # H = 16


def test_0946_norms_and_router_layouts():
    lay = get_profile("flm-0.9.46").layout(FULL, LIN)
    head = [(p.offset, p.role) for p in lay.buffer("norms").placements]
    assert head == [(0, "ssm_conv1d"), (65536, "ssm_norm"), (65792, "ssm_a"), (65920, "ssm_dt_bias"),
                    (66048, "ssm_alpha"), (197120, "ssm_beta"), (328192, "ssm_out")]  # fmt: skip
    assert place("flm-0.9.46", LIN, "norms", "ssm_out").order[:4].tolist() == [0, 16, 1, 17]
    router = {p.role: p for p in lay.buffer("router").placements}
    assert {r: p.offset for r, p in router.items()} == {
        "input_layernorm": 0, "post_attention_layernorm": 0x1000, "shared_expert_gate": 0x2000,
        "moe_router": 0x3000,
    }  # fmt: skip
    t = router["moe_router"].order  # dst element e*2048 + h <- src element h*256 + e
    for e, h in ((0, 0), (0, 1), (1, 0), (255, 2047), (17, 900)):
        assert t[e * 2048 + h] == h * 256 + e
    attn = get_profile("flm-0.9.46").layout(FULL, ATT).buffer("attn_norms")
    assert [(p.offset, p.role) for p in attn.placements] == [(128, "q_norm"), (640, "k_norm")]
    assert attn.zero[0].offset == 0 and attn.zero[0].size == 128


# -- seed-2026-09 ------------------------------------------------------------------------------


def test_seed_check_vectors_and_sizes():
    up = place("seed-2026-09", LIN, "weights", "up_exps")
    src = up.src_offsets()
    assert up.unit_size == 4736 and up.src_pitch == 5120  # tile[0:4736]
    assert src[0] == 0 * 5120 and src[1] == 8 * 5120 and src[2] == 1 * 5120  # rows 0, 1, 2
    assert up.count * up.unit_size == 155_189_248 == 2048 * 75_776 == 32_768 * 4736
    for o in range(64):  # out[o] = trimmed[o//2 + 8(o%2)] within 16-row blocks
        blk, i = divmod(o, 16)
        assert up.order[o] == 16 * blk + i // 2 + 8 * (i % 2)


def test_seed_offsets_table():
    w = get_profile("seed-2026-09").layout(FULL, LIN).buffer("weights")
    got = {p.role: p.offset for p in w.placements}
    assert got == {
        "up_exps": 0x0, "gate_exps": 0x9400000, "down_exps": 0x12800000, "share_up": 0x1BC00000,
        "share_gate": 0x1BC94000, "share_down": 0x1BD28000, "qkv": 0x1BDBC000, "gate_proj": 0x1C6FC000,
    }  # fmt: skip
    assert w.size == 481_935_360
    statuses = {p.role: p.status for p in w.placements}
    for role in ("share_up", "share_gate", "share_down", "qkv", "gate_proj"):
        assert statuses[role] == Status.UNVERIFIED
    for role in ("up_exps", "gate_exps", "down_exps"):
        assert statuses[role] == Status.CLAIMED
    router = get_profile("seed-2026-09").layout(FULL, LIN).buffer("router")
    assert {p.role: (p.offset, p.status) for p in router.placements} == {
        "shared_expert_gate": (0x2000, Status.UNVERIFIED), "moe_router": (0x3000, Status.UNVERIFIED)
    }  # fmt: skip


def test_seed_gate_proj_k_order_and_its_relation_to_v1():
    k = place("seed-2026-09", LIN, "weights", "gate_proj").order
    assert k[:6].tolist() == [232, 225, 233, 226, 234, 227]
    assert all(k[2 * p] - k[2 * p + 1] == 7 for p in range(512))  # (a, a-7) pairs
    v1 = place("flm-1.0.x-pool", LIN, "weights", "gate_proj").order
    assert v1[:5].tolist() == [224, 232, 225, 233, 226]
    assert v1[1:5].tolist() == k[:4].tolist()  # the seed's list is v1.0.x's shifted by one


def test_seed_map_marks_unverified_rows():
    m = build_map(get_profile("seed-2026-09"), FULL, 0)
    rows = {r.tensor: r for b in m.buffers for r in b.rows}
    assert rows["linear_attn.qkv_proj"].status == "unverified"
    assert "2,304 x 5,120" in rows["linear_attn.qkv_proj"].note
    assert rows["mlp.up_exps_proj"].status == "claimed"
    assert "input_layernorm.weight" in m.unplaced


# -- flm-1.0.x-pool ------------------------------------------------------------------------------


def test_pool_rows_literally():
    w = get_profile("flm-1.0.x-pool").layout(FULL, LIN).buffer("weights")
    rows = {}
    for p in w.placements:
        assert p.unit == "window" and p.unit_size == p.src_pitch == 4736
        for off, j in zip(p.dst_offsets().tolist(), p.order.tolist(), strict=True):
            rows[off // 4736] = (p.role, j)
    assert FULL.shape("down_exps").nbytes // 4736 == 35_424
    for r in range(0, 65_536, 997):  # alternating 32-row blocks: up b then gate b
        blk, i = divmod(r, 32)
        b, which = divmod(blk, 2)
        assert rows[r] == (("up_exps", "gate_exps")[which], 32 * b + 8 * (i % 4) + i // 4)
    for r in range(65_536, 100_960, 101):
        g, i = divmod(r - 65_536, 8)
        assert rows[r] == ("down_exps", 8 * g + [0, 2, 4, 6, 1, 3, 5, 7][i])
    gp = [rows[r][1] for r in range(100_960, 102_624)]
    assert all(rows[r][0] == "gate_proj" for r in range(100_960, 102_624))
    assert sorted(gp) == list(range(8)) + list(range(224, 1880))  # {0..7} u {224..1879}
    assert gp[:4] == [224, 232, 225, 233] and gp[-2:] == [1879, 7]  # (v, v+8 mod 1880)
    assert max(rows) == 102_623 and 102_624 * 4736 == 486_027_264
    assert w.zero[0].offset == 486_027_264 and w.zero[0].offset + w.zero[0].size == w.size


def test_v1_norms_buffer():
    n = get_profile("flm-1.0.x-pool").layout(FULL, LIN).buffer("norms")
    assert n.size == 5_242_880
    out = [p for p in n.placements if p.role == "ssm_out"][0]
    assert out.offset == 328_192 and out.offset + out.nbytes == 5_242_880
    for i in range(64):  # j = 32b + 16(i%2) + i//2
        b, k = divmod(i, 32)
        assert out.order[i] == 32 * b + 16 * (k % 2) + k // 2


# -- flm-1.0.5-regionb ------------------------------------------------------------------------------


def test_regionb_sizes_and_reorder():
    w = get_profile("flm-1.0.5-regionb").layout(FULL, LIN).buffer("weights")
    assert w.size == 481_935_360 == 465_567_744 + 3456 * 4736
    b = {p.role: p for p in w.placements if p.region == "B"}
    assert b["share_up"].offset == 0x1BC00000 == 98_304 * 4736
    assert [b[r].offset for r in ("share_gate", "share_down", "qkv", "gate_proj")] == [
        0x1BC94000, 0x1BD28000, 0x1BDBC000, 0x1C6FC000
    ]  # fmt: skip  # the seed's offsets, reproduced
    for role in ("share_up", "share_gate", "share_down"):
        assert b[role].order.tolist() == list(range(128))  # H = 128 / 256 = 0: identity
    for role, h in (("qkv", 8), ("gate_proj", 4)):
        n = b[role].count
        want = [
            2 * h * blk + i // 2 + h * (i % 2) for blk in range(n // (2 * h)) for i in range(2 * h)
        ]
        assert b[role].order.tolist() == want
        assert sorted(want) == list(range(n))  # 2048/2048 and 1024/1024


# -- every profile ------------------------------------------------------------------------------


@pytest.mark.parametrize("profile", [p.name for p in all_profiles()])
@pytest.mark.parametrize("layer", [0, 3])
def test_layouts_compile_without_overlap(profile, layer):
    """Full geometry: placements stay inside their buffers and never overlap."""
    prof = get_profile(profile)
    lay = prof.layout(FULL, FULL.kind(layer))
    refs, total = virtual_refs(FULL, layer, lay.roles())
    plan = compile_layer(prof, FULL, layer, refs, total)
    for bp in plan.buffers:
        assert sum(e - s for s, e, _ in bp.pieces.tolist()) == sum(p.nbytes for p in bp.placements)
        for p in bp.placements:
            assert p.provenance.source
    assert set(lay.roles()).isdisjoint(lay.unplaced)
    assert set(lay.roles()) | set(lay.unplaced) == set(FULL.roles(FULL.kind(layer)))


def test_0946_places_every_tile_exactly_once():
    prof = get_profile("flm-0.9.46")
    for kind in (LIN, ATT):
        lay = prof.layout(FULL, kind)
        seen: dict[str, list[np.ndarray]] = {}
        for b in lay.buffers:
            for p in b.placements:
                seen.setdefault(p.role, []).append(p.order)
        for role, orders in seen.items():
            o = np.sort(np.concatenate(orders))
            n = FULL.shape(role).n_tiles or (
                FULL.shape(role).nbytes // 2 if role == "moe_router" else 1
            )
            assert o.tolist() == list(range(n)), role
        plan_gaps = compile_layer(prof, FULL, 0 if kind == LIN else 3,
                                  *virtual_refs(FULL, 0 if kind == LIN else 3, lay.roles())).buffer("weights").gaps()  # fmt: skip
        assert plan_gaps == []


V, R, C, INF, U = "verified", "reported", "claimed", "inferred", "unverified"
EXPERTS = ("up_exps", "gate_exps", "down_exps")
ROUTER = ("input_layernorm", "post_attention_layernorm", "shared_expert_gate", "moe_router")
NORMS = ("ssm_conv1d", "ssm_norm", "ssm_a", "ssm_dt_bias", "ssm_alpha", "ssm_beta", "ssm_out")
SHARED = ("share_up", "share_gate", "share_down")
# (profile, kind) -> buffer -> (size status, {status: roles}), from the reference's wording:
# byte-checked = verified; read patterns / listed offsets = reported; the seed's disputed
# claim = claimed; carried over from a linear layer or another version = inferred; no
# layout given = unverified.
BufferStatuses = dict[str, tuple[str, dict[str, tuple[str, ...]]]]
STATUSES: dict[tuple[str, LayerKind], BufferStatuses] = {
    ("flm-0.9.46", LIN): {
        "weights": (V, {V: EXPERTS + SHARED + ("qkv", "gate_proj")}),
        "router": (R, {R: ROUTER}), "norms": (R, {R: NORMS}),
    },
    ("flm-0.9.46", ATT): {  # ref §4: pool verified on a linear layer, offsets listed, total inferred
        "weights": (INF, {INF: EXPERTS, R: SHARED + ("q_proj", "k_proj", "v_proj", "o_proj")}),
        "router": (R, {R: ROUTER}), "attn_norms": (V, {V: ("q_norm", "k_norm")}),
    },
    ("flm-1.0.x-pool", LIN): {  # the capture is byte-verified; its buffer's length is not given
        "weights": (INF, {V: EXPERTS + ("gate_proj",)}),
        "router": (INF, {INF: ROUTER}), "norms": (R, {R: NORMS}),
    },
    ("flm-1.0.x-pool", ATT): {
        "weights": (INF, {INF: EXPERTS}), "router": (INF, {INF: ROUTER}),
        "attn_norms": (INF, {INF: ("q_norm", "k_norm")}),
    },
    ("flm-1.0.5-regionb", LIN): {
        "weights": (R, {INF: EXPERTS, R: SHARED + ("qkv", "gate_proj")}),
        "router": (INF, {INF: ROUTER}), "norms": (R, {R: NORMS}),
    },
    ("flm-1.0.5-regionb", ATT): {
        "weights": (INF, {INF: EXPERTS}), "router": (INF, {INF: ROUTER}),
        "attn_norms": (INF, {INF: ("q_norm", "k_norm")}),
    },
    ("seed-2026-09", LIN): {
        "weights": (INF, {C: EXPERTS, U: SHARED + ("qkv", "gate_proj")}),
        "router": (INF, {U: ("shared_expert_gate", "moe_router")}),
    },
    ("seed-2026-09", ATT): {
        "weights": (INF, {INF: EXPERTS}), "router": (INF, {U: ("shared_expert_gate", "moe_router")}),
    },
}  # fmt: skip


@pytest.mark.parametrize("profile, kind", list(STATUSES), ids=lambda x: str(x))
def test_every_placement_and_size_has_its_documented_status(profile, kind):
    lay = get_profile(profile).layout(FULL, kind)
    got = {}
    for b in lay.buffers:
        by: dict[str, set] = {}
        for p in b.placements:
            by.setdefault(p.status.value, set()).add(p.role)
        got[b.name] = (b.size_provenance.status.value, by)
    want = {b: (size, {st: set(roles) for st, roles in by.items()})
            for b, (size, by) in STATUSES[(profile, kind)].items()}  # fmt: skip
    assert got == want


def test_tensor_names_are_flagged_as_a_guess():
    from moepack.npu.profile import TENSOR_NAMES

    assert TENSOR_NAMES.status == Status.UNVERIFIED and "guess" in TENSOR_NAMES.note
    m = build_map(get_profile("flm-0.9.46"), FULL, 0)
    assert m.names_status == "unverified" and "'mlp.up_exps_proj.weight'" in m.names_note
