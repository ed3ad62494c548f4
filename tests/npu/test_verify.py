"""Dump verification: exact matches, named mismatches, ranking, and locating moved bytes."""

from __future__ import annotations

import numpy as np
import pytest

from moepack.errors import BadInput
from moepack.npu.geometry import detect
from moepack.npu.packer import layer_plan, pack_buffer
from moepack.npu.profiles import all_profiles, get_profile
from moepack.npu.q4nx import Q4nxFile
from moepack.npu.verify import verify_dump

from .conftest import FULL, LINEAR


def _dump(model_path, tmp_path, profile, layer, buffer="weights", edit=None):
    with Q4nxFile(model_path) as m:
        plan = layer_plan(m, get_profile(profile), detect(m), layer)
        bp = plan.buffer(buffer)
        buf = pack_buffer(m, bp)
        if edit:
            edit(buf, m, plan)
    path = tmp_path / f"{profile}.{layer}.{buffer}.bin"
    buf.tofile(path)
    return path


@pytest.mark.parametrize("profile", [p.name for p in all_profiles()])
def test_auto_ranks_the_dumps_own_profile_first(model_path, tmp_path, profile):
    dump = _dump(model_path, tmp_path, profile, LINEAR)
    res = verify_dump(dump, model_path, LINEAR, profile="auto")
    assert res.match and res.best.profile == profile and res.best.percent == 100.0
    assert all(s.percent < 100.0 for s in res.scores[1:])
    assert len(res.scores) == len(all_profiles())


def test_mismatch_is_named_by_tensor_tile_and_chunk(model_path, tmp_path):
    with Q4nxFile(model_path) as m:
        plan = layer_plan(m, get_profile("flm-0.9.46"), detect(m), LINEAR)
        bp = plan.buffer("weights")
        gate = [p for p in bp.placements if p.role == "gate_exps"][0]
    # gate's first pair is tiles (0, 8); byte 1024*3 + 512 + 7 of the pair is tile 8, chunk 3, +7
    off = gate.offset + 1024 * 3 + 512 + 7

    def corrupt(buf, m, plan):
        buf[off] ^= 0xFF
        buf[bp.size - 1] ^= 1  # and a byte in region B's last tile

    dump = _dump(model_path, tmp_path, "flm-0.9.46", LINEAR, edit=corrupt)
    res = verify_dump(dump, model_path, LINEAR)
    best = res.best
    assert best is not None and best.size is not None
    assert not res.match and best.size - best.matching == 2
    first = best.mismatches[0]
    assert first.offset == off and first.differing == 1 and first.unit_length == 512
    src = first.source
    assert src is not None
    assert src.tensor == f"model.layer.{LINEAR}.mlp.gate_exps_proj.weight"
    assert (src.tile, src.chunk, src.byte_in_chunk) == (8, 3, 7)
    assert src.tensor_offset == 8 * 5120 + 3 * 512 + 7
    last = best.mismatches[1].source
    assert last is not None
    assert last.tensor.endswith("self_attn.gate_proj.weight")
    scores = {p.tensor.split(".", 3)[-1]: p for p in best.placements}
    assert (
        scores["mlp.gate_exps_proj.weight"].matching
        == scores["mlp.gate_exps_proj.weight"].nbytes - 1
    )
    assert scores["mlp.up_exps_proj.weight"].percent == 100.0


def test_zero_region_mismatch_and_other_buffers(model_path, tmp_path):
    def scribble(buf, m, plan):
        buf[5] = 1  # inside the 128 leading zero bytes

    dump = _dump(model_path, tmp_path, "flm-0.9.46", FULL, "attn_norms", scribble)
    res = verify_dump(dump, model_path, FULL, buffer="attn_norms")
    assert res.best.mismatches[0].source is None and res.best.zero_bytes == 128
    assert res.best.zero_matching == 127


def test_boundary_crossing_row_is_located(model_path, tmp_path):
    """The seed's row 0 as captured: share_up's 824-B tail + up_exps' first 3,912 B (a window
    grid 824 B off the tensor starts). Built from the tensors' bytes by name; verify finds
    exactly that row differing from the seed profile's packed row 0 (tile 0[0:4736]) and
    ``locate`` finds it in the file, straddling both tensors."""
    with Q4nxFile(model_path) as m:
        share = m.raw(f"model.layer.{LINEAR}.mlp.share_up_proj.weight")
        up = m.raw(f"model.layer.{LINEAR}.mlp.up_exps_proj.weight")
        crossing = np.concatenate([share[-824:], up[:3912]])
        tile0 = np.array(up[:4736])

    def shift(buf, m, plan):
        assert np.array_equal(buf[:4736], tile0)  # the packed row 0: the seed's check vector
        buf[:4736] = crossing

    dump = _dump(model_path, tmp_path, "seed-2026-09", LINEAR, edit=shift)
    res = verify_dump(dump, model_path, LINEAR, profile="seed-2026-09", locate_first=1)
    b = res.best
    assert b.judged - b.matching == int(np.count_nonzero(crossing != tile0)) > 4000
    (m0,) = b.mismatches
    assert m0.offset == 0 and m0.unit_start == 0 and m0.unit_length == 4736
    assert m0.source is not None
    assert m0.source.tensor.endswith("up_exps_proj.weight") and m0.source.unit_index == 0
    loc = m0.located
    assert loc is not None and loc.file_offset is not None
    assert loc.matching == 4736
    with Q4nxFile(model_path) as m:
        assert np.array_equal(m.u8[loc.file_offset : loc.file_offset + 4736], crossing)
    n = share.size
    assert loc.pieces == [
        f"model.layer.{LINEAR}.mlp.share_up_proj.weight[{n - 824:,}:{n:,}] (824 B)",
        f"model.layer.{LINEAR}.mlp.up_exps_proj.weight[0:3,912] (3,912 B)",
    ]


def test_wrong_size_dump_and_missing_buffer(model_path, tmp_path):
    dump = tmp_path / "short.bin"
    dump.write_bytes(b"\0" * 1000)
    with pytest.raises(
        BadInput,
        match=r"dump is 1,000 bytes; profile flm-0.9.46's weights "
        r"buffer .* is 43,843,584 bytes \(a verified size: ref §4: 0x1FCB0000",
    ):
        verify_dump(dump, model_path, LINEAR)  # fmt: skip
    res = verify_dump(dump, model_path, LINEAR, profile="auto")  # inferred sizes: compared
    assert not res.match and res.best.percent < 0.01
    assert {s.profile for s in res.scores if not s.comparable} == {
        "flm-0.9.46",
        "flm-1.0.5-regionb",
    }
    with pytest.raises(BadInput, match="has no 'norms' buffer"):
        verify_dump(dump, model_path, LINEAR, buffer="norms", profile="seed-2026-09")
    with pytest.raises(BadInput, match="layer 9 is not in the model"):
        verify_dump(dump, model_path, 9)


def test_inferred_buffer_size_compares_the_overlap(cli, model_path, tmp_path):
    """flm-1.0.x-pool's weights size is inferred (0.9.46's allocation): a dump of another
    size is compared over the overlap and the size difference reported, not refused."""
    data = _dump(model_path, tmp_path, "flm-1.0.x-pool", LINEAR).read_bytes()
    with Q4nxFile(model_path) as m:
        geo = detect(m)
    spec = get_profile("flm-1.0.x-pool").layout(geo, geo.kind(LINEAR)).buffer("weights")
    end = spec.zero[0].offset  # the pool ends here; zero after (ref §5)
    assert spec.size_provenance.status.value == "inferred" and end < spec.size
    short = tmp_path / "short.bin"
    short.write_bytes(data[: end + 4096])
    res = verify_dump(short, model_path, LINEAR, profile="flm-1.0.x-pool")
    b = res.best
    assert res.match and b.compared == end + 4096 and b.missing == 0 and b.size_differs
    assert f"dump {end + 4096:,} B, buffer {len(data):,} B (inferred: the 0.9.46" in b.reason
    longer = tmp_path / "long.bin"
    longer.write_bytes(data + b"\0" * 8192 + b"\1" * 10)
    b = verify_dump(longer, model_path, LINEAR, profile="flm-1.0.x-pool").best
    assert b.matching == b.judged == len(data) and (b.extra, b.extra_nonzero) == (8202, 10)
    assert "the dump's last 8,202 B (10 nonzero) are past the buffer" in b.reason
    cut = tmp_path / "cut.bin"  # the pool's last row is missing: that is a difference
    cut.write_bytes(data[: end - 4736])
    res = verify_dump(cut, model_path, LINEAR, profile="flm-1.0.x-pool")
    assert (
        not res.match and res.best.missing == 4736 and res.best.judged - res.best.matching == 4736
    )
    r = cli("npu", "verify", "--dump", short, "--model", model_path, "--layer", LINEAR,
            "--profile", "flm-1.0.x")  # fmt: skip
    assert r.code == 0 and "the sizes differ" in r.out, r.err
    r = cli("npu", "verify", "--dump", cut, "--model", model_path, "--layer", LINEAR,
            "--profile", "flm-1.0.x")  # fmt: skip
    assert r.code == 1 and "(4,736 bytes differ)" in r.one_line_error()
