"""The fast packer against the reference packer, pack/unpack round trips, and reading tiles
back through packed buffers — on every profile and both layer kinds."""

from __future__ import annotations

import numpy as np
import pytest

from moepack.npu.codecs import dequantize
from moepack.npu.geometry import Geometry, detect
from moepack.npu.inverse import dequantize_tile, source_bytes
from moepack.npu.packer import layer_plan, pack_buffer, pack_layer
from moepack.npu.plan import TensorRef, compile_buffer, retained_intervals
from moepack.npu.profiles import all_profiles, get_profile
from moepack.npu.q4nx import Q4nxFile
from moepack.npu.refpacker import pack_buffer_ref
from moepack.npu.unpack import unpack

from .conftest import FULL, LINEAR

PROFILES = [p.name for p in all_profiles()]


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("layer", [LINEAR, FULL])
def test_fast_packer_equals_reference(model_path, profile, layer):
    with Q4nxFile(model_path) as m:
        plan = layer_plan(m, get_profile(profile), detect(m), layer)
        for bp in plan.buffers:
            fast = pack_buffer(m, bp)
            ref = pack_buffer_ref(bp.spec, bp.refs, m.u8)
            assert fast.tobytes() == bytes(ref), bp.name
            placed = sum(s.nbytes for s in bp.segments)
            assert placed == sum(p.nbytes for p in bp.placements)
            assert not fast[_gap_mask(bp)].any()  # everything unplaced is zero


def _gap_mask(bp):
    mask = np.zeros(bp.size, bool)
    for s, e in bp.gaps():
        mask[s:e] = True
    return mask


def test_0946_is_a_pure_permutation_of_tiles(model_path):
    """Packing only moves whole tiles: the packed pool holds exactly the source tiles."""
    with Q4nxFile(model_path) as m:
        geo = detect(m)
        plan = layer_plan(m, get_profile("flm-0.9.46"), geo, LINEAR)
        w = pack_layer(m, plan, ["weights"])["weights"]
        pool = [p for p in plan.buffer("weights").placements if p.region.startswith("A")]
        n = sum(p.count for p in pool)
        # undo the 512-B chunk interleave of each pair, then compare tile multisets
        pairs = w[: n * 5120].reshape(n // 2, 10, 2, 512).transpose(0, 2, 1, 3).reshape(n, 5120)
        src = np.concatenate([m.raw(geo.name_of(r, LINEAR)).reshape(-1, 5120) for r in
                              ("up_exps", "gate_exps", "down_exps")])  # fmt: skip
        key = lambda a: np.sort(a.view([("", "V5120")]).ravel())  # noqa: E731
        assert np.array_equal(key(pairs), key(src))


def test_fallback_for_unaligned_tensors():
    """Tensors at offsets that break every granule congruence still pack exactly."""
    geo = Geometry.scaled()
    prof = get_profile("flm-0.9.46")
    spec = prof.layout(geo, geo.kind(LINEAR)).buffer("weights")
    rng = np.random.default_rng(5)
    refs, at = {}, 3
    for role in dict.fromkeys(p.role for p in spec.placements):
        shape = geo.shape(role)
        refs[role] = TensorRef(role, role, at, shape.nbytes, shape)
        at += shape.nbytes + int(rng.integers(1, 7))  # odd gaps: no common residue
    src = rng.integers(0, 256, at + 8, dtype=np.uint8)
    bp = compile_buffer(spec, [refs[p.role] for p in spec.placements], src.size)
    assert {s.mode for s in bp.segments} >= {"take"}
    from moepack.npu.gather import gather

    buf = np.zeros(bp.size, np.uint8)
    gather(buf, bp, src)
    assert buf.tobytes() == bytes(pack_buffer_ref(spec, bp.refs, src))


def test_bytes_mode_fallback_when_no_granule_fits():
    geo = Geometry.scaled()
    spec = get_profile("flm-1.0.x-pool").layout(geo, geo.kind(LINEAR)).buffer("norms")
    rng = np.random.default_rng(6)
    refs, at = {}, 1
    for p in spec.placements:
        shape = geo.shape(p.role)
        refs[p.role] = TensorRef(p.role, p.role, at, shape.nbytes, shape)
        at += shape.nbytes + 1
    src = rng.integers(0, 256, at, dtype=np.uint8)
    bp = compile_buffer(spec, [refs[p.role] for p in spec.placements], src.size)
    from moepack.npu.gather import gather

    buf = np.zeros(bp.size, np.uint8)
    gather(buf, bp, src)
    assert buf.tobytes() == bytes(pack_buffer_ref(spec, bp.refs, src))


@pytest.mark.parametrize("profile", PROFILES)
def test_unpack_returns_every_retained_byte(model_path, packed, tmp_path, profile):
    out = tmp_path / "back.q4nx"
    res = unpack(packed(profile), out, check_model=model_path)
    assert res.check_mismatches and not any(res.check_mismatches.values())
    with Q4nxFile(out) as back, Q4nxFile(model_path) as src:
        assert back.metadata["moepack.unpacked_from"] == profile
        geo = detect(src)
        kept: dict[str, np.ndarray] = {}  # tensor name -> byte mask of what the profile keeps
        for layer in (LINEAR, FULL):
            lay = get_profile(profile).layout(geo, geo.kind(layer))
            for b in lay.buffers:
                for p in b.placements:
                    name = geo.name_of(p.role, layer)
                    mask = kept.setdefault(name, np.zeros(src.entries[name].nbytes, bool))
                    for s, e in retained_intervals(p).tolist():
                        mask[s:e] = True
        assert {row.name for row in res.tensors} == {n for n, m in kept.items() if m.any()}
        for row in res.tensors:
            a, c, mask = back.raw(row.name), src.raw(row.name), kept[row.name]
            assert row.retained == int(mask.sum()), row.name
            assert np.array_equal(a[mask], c[mask]), row.name  # every kept byte comes back
            assert not a[~mask].any(), row.name  # and nothing else is invented
    if profile == "flm-0.9.46":
        assert all(t.retained == t.nbytes for t in res.tensors) and not res.left_out


def test_dequantise_through_packed_buffers(model_path):
    rng = np.random.default_rng(0)
    with Q4nxFile(model_path) as m:
        geo = detect(m)
        for profile, layer, roles in (
            (
                "flm-0.9.46",
                LINEAR,
                ("up_exps", "gate_exps", "down_exps", "qkv", "gate_proj", "ssm_out"),
            ),
            ("flm-0.9.46", FULL, ("q_proj", "o_proj", "share_down")),
            ("flm-1.0.x-pool", LINEAR, ("up_exps", "down_exps")),
            ("flm-1.0.5-regionb", LINEAR, ("gate_exps", "qkv")),
        ):
            plan = layer_plan(m, get_profile(profile), geo, layer)
            bufs = pack_layer(m, plan)
            for role in roles:
                ref = plan.tensors[role]
                size = ref.shape.tile_size
                for tile in rng.integers(0, ref.shape.n_tiles // 4, 3).tolist():
                    got = dequantize_tile(plan, bufs, role, tile)
                    assert size is not None
                    want = dequantize(m.raw(ref.name)[tile * size : (tile + 1) * size], size)[0]
                    assert got is not None and np.array_equal(got, want), (profile, role, tile)
        # the seed trims 384 B of every tile: no tile can be read back whole
        plan = layer_plan(m, get_profile("seed-2026-09"), geo, LINEAR)
        bufs = pack_layer(m, plan)
        assert dequantize_tile(plan, bufs, "up_exps", 5) is None
        data, have = source_bytes(plan, bufs, "up_exps", 5 * 5120, 5120)
        assert have[:4736].all() and not have[4736:].any()
        assert np.array_equal(
            data[:4736], m.raw(plan.tensors["up_exps"].name)[5 * 5120 : 5 * 5120 + 4736]
        )


def test_seed_check_vectors_on_packed_bytes(model_path):
    """Seed: 16-row blocks of trimmed tiles, row 0 == tile 0[0:4736], row 1 == tile 8[0:4736],
    row 2 == tile 1[0:4736], on the bytes the packer produces for up, gate and down (each
    32,768 rows of 4,736 B at full size: 2,048 blocks of 75,776 B)."""
    with Q4nxFile(model_path) as m:
        geo = detect(m)
        plan = layer_plan(m, get_profile("seed-2026-09"), geo, LINEAR)
        w = pack_layer(m, plan, ["weights"])["weights"]
        for i, role in enumerate(("up_exps", "gate_exps", "down_exps")):
            tiles = m.raw(geo.name_of(role, LINEAR)).reshape(-1, 5120)
            n = len(tiles)
            rows = w[i * n * 4736 : (i + 1) * n * 4736].reshape(n, 4736)
            assert np.array_equal(rows[0], tiles[0, :4736])
            assert np.array_equal(rows[1], tiles[8, :4736])
            assert np.array_equal(rows[2], tiles[1, :4736])
            assert np.array_equal(rows[16], tiles[16, :4736]) and np.array_equal(
                rows[17], tiles[24, :4736]
            )
            o = np.arange(n)
            assert np.array_equal(rows, tiles[16 * (o // 16) + (o % 16) // 2 + 8 * (o % 2), :4736])
    assert Geometry.full().shape("up_exps").n_tiles * 4736 == 155_189_248 == 2048 * 75_776


@pytest.mark.parametrize("profile", PROFILES)
def test_buffers_built_a_window_at_a_time_equal_whole_ones(model_path, profile):
    """pack writes each buffer in windows whose edges cut granules (512-B chunks, 4,736-B
    windows, whole tensors) anywhere: every window must hold exactly the buffer's bytes."""
    from moepack.npu.gather import gather_range

    rng = np.random.default_rng(11)
    with Q4nxFile(model_path) as m:
        plan = layer_plan(m, get_profile(profile), detect(m), LINEAR)
        for bp in plan.buffers:
            whole = pack_buffer(m, bp)
            cuts = np.unique(np.concatenate([[0, bp.size], rng.integers(0, bp.size, 40)]))
            if bp.size > 8 * 1024 * 1024:  # also a run of small, odd windows somewhere inside
                at = int(rng.integers(0, bp.size - 200_000))
                cuts = np.unique(np.concatenate([cuts, np.arange(at, at + 200_000, 4099)]))
            for lo, hi in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True):
                part = np.full(hi - lo, 0xA5, np.uint8)  # garbage: gaps must be zeroed
                gather_range(part, bp, m.u8, lo)
                assert np.array_equal(part, whole[lo:hi]), (bp.name, lo, hi)


def test_plans_are_compiled_once_per_layer_kind(model_path, tmp_path):
    """Layers of one kind share a compiled plan (their tensors sit alike); each layer's plan
    reads its own tensors (different base), and the packed bytes stay exact."""
    from moepack.npu import plan as plan_mod
    from moepack.npu.synth import synth

    path = tmp_path / "four.q4nx"
    synth(path, "scaled", "0-2", seed=3)
    plan_mod._COMPILED.clear()
    with Q4nxFile(path) as m:
        geo = detect(m)
        prof = get_profile("flm-0.9.46")
        plans = [layer_plan(m, prof, geo, layer) for layer in (0, 1, 2)]
        assert len(plan_mod._COMPILED) == 1
        assert plans[0].buffers[0].segments is plans[2].buffers[0].segments
        assert len({p.buffers[0].base for p in plans}) == 3
        for p in plans:
            for bp in p.buffers:
                assert pack_buffer(m, bp).tobytes() == bytes(
                    pack_buffer_ref(bp.spec, bp.refs, m.u8)
                )
