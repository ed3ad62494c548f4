"""``moepack compare``: metrics against llama.cpp's quantisations, across a repacked file,
bounded chunks, and every kind of bad input."""

from __future__ import annotations

import json
from typing import cast

import numpy as np
import pytest
from gguf import GGUFWriter

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.synth import synth_model
from moepack.errors import BadInput
from moepack.layout.plan import LayerPlan, Plan
from moepack.quant.compare import compare
from moepack.quant.metrics import DiffStats
from moepack.rewrite.repack import repack
from quantfixtures import FTYPES, HAVE_GGML, f32_model, llama_quantise

needs_ggml = pytest.mark.skipif(not HAVE_GGML, reason="llama-cpp-python missing")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compare")
    f32 = f32_model(folder)
    out = {"F32": f32}
    if HAVE_GGML:
        for name in ("Q4_K_M", "Q6_K"):
            dst = folder / f"{name}.gguf"
            assert llama_quantise(f32, dst, FTYPES[name][0]).returncode == 0
            out[name] = dst
    return out


def _by_name(result):
    return {t.name: t for t in result.tensors}


def test_diffstats_in_chunks_equal_numpy_on_the_whole():
    rng = np.random.default_rng(1)
    a = rng.standard_normal(200_000).astype(np.float32)
    b = (a + 0.05 * rng.standard_normal(a.size) + 0.01).astype(np.float32)
    s = DiffStats()
    for lo in range(0, a.size, 99_999):
        s.add(a[lo : lo + 99_999], b[lo : lo + 99_999])
    m = s.metrics()
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    d = b64 - a64
    # float32 pieces, float64 totals: 1 - r keeps six significant digits
    assert m.correlation is not None
    assert 1 - m.correlation == pytest.approx(1 - np.corrcoef(a64, b64)[0, 1], rel=1e-6)
    assert m.rmse == pytest.approx(np.sqrt(np.mean(d**2)), rel=1e-6)
    assert m.rel_error == pytest.approx(np.linalg.norm(d) / np.linalg.norm(a64), rel=1e-6)
    assert m.max_abs == pytest.approx(np.abs(d).max())
    assert m.cosine == pytest.approx(a64 @ b64 / np.linalg.norm(a64) / np.linalg.norm(b64))
    assert m.snr_db == pytest.approx(10 * np.log10((a64 @ a64) / (d @ d)), rel=1e-6)
    assert not m.identical


@needs_ggml
def test_q4_k_m_against_its_f32_source_and_both_engines_agree(models):
    by_gguf = compare(models["F32"], models["Q4_K_M"], per_expert=True)
    by_ggml = compare(models["F32"], models["Q4_K_M"], per_expert=True, engine="ggml")
    assert by_gguf.ok and by_ggml.ok
    up = _by_name(by_gguf)["blk.0.ffn_up_exps.weight"]
    assert up.type_cand == "Q4_K" and up.engine_cand == "gguf"
    assert 0.99 < up.metrics.correlation < 0.9999 and 0.01 < up.metrics.rel_error < 0.2
    assert [e.expert for e in up.experts] != [] and len(up.experts) == 4
    worst_first = [e.metrics.correlation for e in up.experts]
    assert worst_first == sorted(worst_first)
    for t in by_ggml.tensors:  # bit-exact codecs: identical metrics
        assert t.metrics == _by_name(by_gguf)[t.name].metrics
    assert _by_name(by_ggml)["blk.0.ffn_up_exps.weight"].engine_cand == "ggml"
    norm = _by_name(by_gguf)["blk.0.ffn_norm.weight"]
    assert norm.metrics.identical and norm.metrics.snr_db is None


@needs_ggml
def test_tiny_chunks_give_the_same_numbers(models):
    whole = compare(models["F32"], models["Q6_K"], tensor_pattern="blk.0.ffn_*_exps.weight")
    tiny = compare(
        models["F32"], models["Q6_K"], tensor_pattern="blk.0.ffn_*_exps.weight", chunk_values=256
    )
    assert len(whole.tensors) == 3
    for a, b in zip(whole.tensors, tiny.tensors, strict=True):
        assert a.metrics.correlation == pytest.approx(b.metrics.correlation, abs=1e-9)
        assert a.metrics.max_abs == b.metrics.max_abs


@needs_ggml
def test_a_repacked_file_is_matched_expert_by_expert(tmp_path, models):
    with MoeModel(models["F32"]) as m:
        perm = np.array([2, 0, 3, 1])
        plan = Plan([LayerPlan(b.index, perm) for b in m.blocks], m.fingerprint, source="test")
    repacked = tmp_path / "r.gguf"
    repack(models["F32"], plan, repacked)
    same = compare(models["F32"], repacked, per_expert=True)
    assert same.ok and all(t.metrics.identical for t in same.tensors)
    up = _by_name(same)["blk.0.ffn_up_exps.weight"]
    assert {(e.expert, e.slot_ref, e.slot_cand) for e in up.experts} == {
        (0, 0, 1),
        (1, 1, 3),
        (2, 2, 0),
        (3, 3, 2),
    }
    direct = compare(models["F32"], models["Q4_K_M"])
    through = compare(repacked, models["Q4_K_M"])
    for t in direct.tensors:
        assert _by_name(through)[t.name].metrics == t.metrics


@needs_ggml
def test_cli_table_json_and_a_failed_verdict(capsys, models):
    code, out, _ = run_cli(capsys, "compare", models["F32"], models["Q4_K_M"], "--per-expert")
    assert code == 0 and "PASS" in out and "worst" in out
    code, out, err = run_cli(
        capsys, "compare", models["F32"], models["Q4_K_M"], "--min-correlation", "0.9999", "--json"
    )
    assert code == 1
    doc = json.loads(out)
    assert doc["ok"] is False and any(not t["ok"] for t in doc["tensors"])
    assert "correlation" in err and err.count("\n") == 1
    code, out, _ = run_cli(
        capsys, "compare", models["F32"], models["Q6_K"], "--limit", "2", "--json"
    )
    assert code == 0 and len(json.loads(out)["tensors"]) == 2


def test_two_different_models_name_the_first_mismatching_tensor(tmp_path, capsys):
    a = synth_model(tmp_path / "a.gguf", tiny_spec()).paths[0]
    b = synth_model(tmp_path / "b.gguf", tiny_spec(hidden=128)).paths[0]
    with pytest.raises(BadInput, match="token_embd.weight"):
        compare(a, b)
    c = synth_model(tmp_path / "c.gguf", tiny_spec(layers=3)).paths[0]
    code, _, err = run_cli(capsys, "compare", a, c)
    assert code == 2 and "blk.2." in err and "is extra" in err and "Traceback" not in err


def test_a_pattern_matching_nothing_is_bad_input(tmp_path, capsys):
    a = synth_model(tmp_path / "a.gguf", tiny_spec()).paths[0]
    code, _, err = run_cli(capsys, "compare", a, a, "--tensor", "blk.*.nothing*")
    assert code == 2 and "no tensor matches 'blk.*.nothing*'" in err


def _two_tensor_file(path, values, ints):
    w = GGUFWriter(path, "qwen3moe")
    w.add_tensor("x.weight", values)
    w.add_tensor("ids", ints)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unknown_types_are_skipped_and_non_finite_values_counted(tmp_path, capsys):
    values = np.linspace(-1, 1, 512, dtype=np.float32)
    ints = np.arange(64, dtype=np.int32)
    ref = _two_tensor_file(tmp_path / "ref.gguf", values, ints)
    bad = values.copy()
    bad[[3, 100, 200]] = [np.nan, np.inf, -np.inf]
    cand = _two_tensor_file(tmp_path / "cand.gguf", bad, ints)
    r = compare(ref, cand)
    assert [(s.name, s.type_ref) for s in r.skipped] == [("ids", "I32")]
    (x,) = r.tensors
    assert (x.metrics.nonfinite_ref, x.metrics.nonfinite_cand) == (0, 3)
    assert x.metrics.values == 509 and x.metrics.rmse == 0.0
    assert not r.ok and "non-finite" in x.failures[0]
    code, out, err = run_cli(capsys, "compare", ref, cand)
    assert code == 1 and "skipped ids (I32→I32)" in out and "non-finite" in err


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2", "qwen2moe", "mixtral", "gpt-oss"])
def test_every_synthetic_family_compares_per_expert(tmp_path, arch):
    ref = synth_model(tmp_path / "f.gguf", tiny_spec(arch=arch)).paths[0]
    cand = synth_model(tmp_path / "q.gguf", tiny_spec(arch=arch, weight_type="Q8_0")).paths[0]
    r = compare(ref, cand, per_expert=True)
    assert r.ok and not r.skipped
    with MoeModel(ref) as m:
        expert_names = {t.name for b in m.blocks for t in b.tensors}
    assert expert_names and {t.name for t in r.tensors if t.experts} == expert_names
    q8 = [t for t in r.tensors if t.type_cand == "Q8_0"]
    assert q8 and all(0.9999 < cast(float, t.metrics.correlation) < 1 for t in q8)


def test_a_split_checkpoint_compares_like_the_single_file(tmp_path):
    single = synth_model(tmp_path / "one.gguf", tiny_spec()).paths[0]
    parts = synth_model(tmp_path / "s.gguf", tiny_spec(), split_max_size=200_000).paths
    assert len(parts) > 1
    r = compare(single, parts[1])
    assert r.ok and len(r.tensors) > 10 and all(t.metrics.identical for t in r.tensors)


def _moe_file(path, tensors, qtype=None):
    """A one-block qwen3moe-shaped GGUF with the given expert tensors (numpy shapes)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    w = GGUFWriter(path, "qwen3moe")
    w.add_uint32("qwen3moe.block_count", 1)
    w.add_uint32("qwen3moe.expert_count", 4)
    w.add_uint32("qwen3moe.expert_used_count", 2)
    for name, values in tensors.items():
        if qtype is None or "gate_inp" in name:
            w.add_tensor(name, values)
        else:
            t = GGMLQuantizationType.Q8_0
            w.add_tensor(name, quantize(values, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_fused_gate_up_is_matched_half_by_half_both_ways(tmp_path, capsys):
    rng = np.random.default_rng(5)
    e, f, n = 4, 64, 128
    gate, up, down = (
        rng.standard_normal(s).astype(np.float32) for s in [(e, f, n)] * 2 + [(e, n, f)]
    )
    router = rng.standard_normal((e, n)).astype(np.float32)
    split = {
        "blk.0.ffn_gate_inp.weight": router,
        "blk.0.ffn_gate_exps.weight": gate,
        "blk.0.ffn_up_exps.weight": up,
        "blk.0.ffn_down_exps.weight": down,
    }
    fused = {
        "blk.0.ffn_gate_inp.weight": router,
        "blk.0.ffn_gate_up_exps.weight": np.concatenate([gate, up], axis=1),
        "blk.0.ffn_down_exps.weight": down,
    }
    split_f32 = _moe_file(tmp_path / "split.gguf", split)
    split_q8 = _moe_file(tmp_path / "split_q8.gguf", split, qtype="Q8_0")
    fused_f32 = _moe_file(tmp_path / "fused.gguf", fused)
    fused_q8 = _moe_file(tmp_path / "fused_q8.gguf", fused, qtype="Q8_0")

    same = compare(split_f32, fused_f32, per_expert=True)
    assert same.ok and all(t.metrics.identical for t in same.tensors)
    up_diff = _by_name(same)["blk.0.ffn_up_exps.weight"]
    assert up_diff.cand_tensor == "blk.0.ffn_gate_up_exps.weight" and len(up_diff.experts) == 4

    direct = _by_name(compare(split_f32, split_q8))
    for ref, cand in ((split_f32, fused_q8), (fused_f32, split_q8)):
        across = _by_name(compare(ref, cand))
        assert set(across) == set(direct)
        for name, t in direct.items():
            assert across[name].metrics == t.metrics
            assert t.metrics.identical == (name == "blk.0.ffn_gate_inp.weight")

    code, out, _ = run_cli(capsys, "compare", split_f32, fused_f32, "--per-expert")
    assert code == 0 and "blk.0.ffn_up_exps.weight (fused in cand)" in out
    code, out, _ = run_cli(capsys, "compare", fused_f32, split_q8, "--tensor", "*gate_up*")
    assert code == 0 and out.count("(fused in ref)") == 2

    wrong = {**split, "blk.0.ffn_up_exps.weight": up[:, : f // 2]}
    code, _, err = run_cli(capsys, "compare", _moe_file(tmp_path / "w.gguf", wrong), fused_f32)
    assert code == 2 and "does not hold 'blk.0.ffn_up_exps.weight'" in err


def test_values_near_the_float32_limit_fail_without_numpy_warnings(tmp_path, capsys):
    """16 values of 3e38 in a candidate: the float32 sums overflowed (four numpy warnings on
    stderr), the correlation cancelled to 1.000000 and the verdict was ok, at a relative
    error of 7e37 %. Now measured in float64, and the tensor fails on both counts."""
    import warnings

    values = np.linspace(-1, 1, 4096, dtype=np.float32)
    ints = np.arange(64, dtype=np.int32)
    ref = _two_tensor_file(tmp_path / "ref.gguf", values, ints)
    bad = values.copy()
    bad[np.arange(16) * 200] = 3e38
    cand = _two_tensor_file(tmp_path / "cand.gguf", bad, ints)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a RuntimeWarning from numpy fails the test
        r = compare(ref, cand)
    (x,) = r.tensors
    want = np.corrcoef(values.astype(np.float64), bad.astype(np.float64))[0, 1]
    assert not r.ok and x.metrics.correlation == pytest.approx(want, abs=1e-6)
    assert (x.metrics.rel_error or 0.0) > 1e37
    assert any("absurd" in f for f in x.failures)
    code, out, err = run_cli(capsys, "compare", ref, cand)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "Warning" not in err, err
    assert f"correlation {want:.6f} < 0.99" in lines[0] and "3.25e+39 %" in out


def test_a_scaled_candidate_correlates_perfectly_and_still_fails(tmp_path):
    """Correlation alone cannot see a candidate a thousand times its reference."""
    values = np.linspace(-1, 1, 512, dtype=np.float32)
    ints = np.arange(8, dtype=np.int32)
    ref = _two_tensor_file(tmp_path / "ref.gguf", values, ints)
    cand = _two_tensor_file(tmp_path / "cand.gguf", values * 1000, ints)
    (x,) = compare(ref, cand).tensors
    assert x.metrics.correlation == pytest.approx(1.0)
    assert x.failures == [
        f"relative error {x.metrics.rel_error:.3g} is absurd (the difference is larger than "
        "the reference itself)"
    ]


def test_correlation_of_far_apart_spreads_matches_numpy():
    rng = np.random.default_rng(1)
    a = rng.standard_normal(70_000).astype(np.float32)
    for scale in (1e-3, 0.3, 1.0, 7.0, 1e6):
        b = (0.5 * a + rng.standard_normal(a.size).astype(np.float32)) * np.float32(scale)
        s = DiffStats()
        s.add(a, b)
        want = np.corrcoef(a.astype(np.float64), b.astype(np.float64))[0, 1]
        assert s.metrics().correlation == pytest.approx(want, abs=1e-6)


def test_signalling_nans_are_counted_without_numpy_warnings():
    """Random bytes in a tensor hold signalling NaNs: widening them raised numpy's invalid
    flag ("invalid value encountered in cast") on stderr, a second line beside the error."""
    import warnings

    a = np.linspace(-1, 1, 4096, dtype=np.float32)
    b = a.copy()
    b.view(np.uint32)[[5, 70]] = 0x7F800001  # signalling NaN
    s = DiffStats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.add(a, b)
    assert s.metrics().nonfinite_cand == 2


def test_a_trailing_dimension_of_one_is_no_dimension(tmp_path, capsys):
    """llama.cpp's converter writes qwen2moe's shared-expert gate as ``[n]`` in one file and
    ``[n, 1]`` in another (and ERNIE's ``exp_probs_b`` as ``[n_expert, 1]``); llama.cpp loads
    both the same, so ``compare`` pairs them, per expert too; another length is still refused."""
    rng = np.random.default_rng(11)
    e, f, n = 4, 32, 64
    base = {
        "blk.0.ffn_gate_inp.weight": rng.standard_normal((e, n)).astype(np.float32),
        "blk.0.ffn_gate_exps.weight": rng.standard_normal((e, f, n)).astype(np.float32),
        "blk.0.ffn_up_exps.weight": rng.standard_normal((e, f, n)).astype(np.float32),
        "blk.0.ffn_down_exps.weight": rng.standard_normal((e, n, f)).astype(np.float32),
    }
    shexp = rng.standard_normal(n).astype(np.float32)
    bias = rng.standard_normal(e).astype(np.float32)
    flat = _moe_file(
        tmp_path / "flat.gguf",
        {**base, "blk.0.ffn_gate_inp_shexp.weight": shexp, "blk.0.exp_probs_b.bias": bias},
    )
    ones = {
        **base,
        "blk.0.ffn_gate_inp_shexp.weight": shexp.reshape(1, n),  # ggml ne [n, 1]
        "blk.0.exp_probs_b.bias": bias.reshape(1, e),  # ggml ne [e, 1]
    }
    padded = _moe_file(tmp_path / "padded.gguf", ones)
    # the expert matrices in Q8_0, the gate and bias in F32 (as llama.cpp keeps them)
    padded_q8 = _moe_file(
        tmp_path / "padded_q8.gguf",
        {k: v for k, v in ones.items() if k != "blk.0.exp_probs_b.bias"},
        qtype="Q8_0",
    )
    with MoeModel(padded) as m:
        assert list(m.tensors["blk.0.ffn_gate_inp_shexp.weight"].ne) == [n, 1]
    for a, b in ((flat, padded), (padded, flat)):
        r = compare(a, b, per_expert=True)
        assert r.ok and all(t.metrics.identical for t in r.tensors)
        got = _by_name(r)
        assert got["blk.0.ffn_gate_inp_shexp.weight"].metrics.values == n
        assert len(got["blk.0.exp_probs_b.bias"].experts) == e  # the expert axis, per expert
    ref = _moe_file(tmp_path / "ref.gguf", {**base, "blk.0.ffn_gate_inp_shexp.weight": shexp})
    r = compare(ref, padded_q8)
    assert r.ok and _by_name(r)["blk.0.ffn_gate_inp_shexp.weight"].metrics.identical
    assert _by_name(r)["blk.0.ffn_up_exps.weight"].type_cand == "Q8_0"
    code, out, err = run_cli(capsys, "compare", ref, padded_q8, "--json")
    assert code == 0, err
    longer = {**ones, "blk.0.ffn_gate_inp_shexp.weight": np.zeros((2, n), np.float32)}
    code, _, err = run_cli(capsys, "compare", flat, _moe_file(tmp_path / "x.gguf", longer))
    assert code == 2 and "ffn_gate_inp_shexp" in err and "[64, 2], not [64]" in err


def test_bytes_retyped_to_nan_fail_in_one_line_without_numpy_warnings(tmp_path, capsys):
    """Q4_0 expert tensors whose header type was changed to Q4_K (same bytes per value): the
    bytes decode to NaN and infinities (Q4_K's ``dmin`` read from Q4_0's quants), gguf-py's
    codec made numpy print "invalid value encountered in multiply" before compare's line. Now
    no warning, and the line says first that the tensor decodes to non-finite values."""
    import struct
    import warnings

    from gguf import GGMLQuantizationType

    from moepack.checkpoint.gguf_file import GgufFile

    spec = tiny_spec(layers=1, hidden=256, expert_ffn=256, head_dim=64, weight_type="Q4_0")
    ref = synth_model(tmp_path / "q4_0.gguf", spec).paths[0]
    raw = bytearray(ref.read_bytes())
    retyped = [t for t in GgufFile(ref).tensors if t.name.endswith("_exps.weight")]
    for t in retyped:  # the tensor info ends with the type (u32) and the data offset (u64)
        assert struct.unpack_from("<I", raw, t.info_end - 12)[0] == GGMLQuantizationType.Q4_0
        struct.pack_into("<I", raw, t.info_end - 12, GGMLQuantizationType.Q4_K)
    cand = tmp_path / "retyped.gguf"
    cand.write_bytes(bytes(raw))
    for engine in ("gguf", *(("ggml",) if HAVE_GGML else ())):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a RuntimeWarning from numpy fails the test
            r = compare(ref, cand, engine=engine, workers=1)
        bad = {t.name: t for t in r.tensors if not t.ok}
        assert set(bad) == {t.name for t in retyped}
        assert all(t.failures[0].startswith("decodes to non-finite values") for t in bad.values())
    code, _out, err = run_cli(capsys, "compare", ref, cand, "-q")
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "Warning" not in err, err
    assert "retyped.gguf: tensor 'blk.0.ffn_gate_exps.weight': decodes to non-finite" in lines[0]


def test_two_swapped_router_rows_fail_where_the_tensor_correlates(tmp_path, capsys):
    """Router rows of experts 3 and 7 swapped among 512: the tensor's correlation (0.996)
    passes 0.99 and its relative error (9 %) is what honest Q4_0 reaches, but each of the two
    rows is about 141 % off its own expert's, which no quantisation is (``bench_router_verdict.py``)."""
    from moepack.checkpoint.gguf_file import GgufFile

    spec = tiny_spec(layers=1, experts=512, hidden=64, expert_ffn=32)
    ref = synth_model(tmp_path / "ref.gguf", spec).paths[0]
    t = GgufFile(ref).by_name["blk.0.ffn_gate_inp.weight"]
    raw = bytearray(ref.read_bytes())
    row = t.n_bytes // 512
    three, seven = (slice(t.offset + e * row, t.offset + (e + 1) * row) for e in (3, 7))
    raw[three], raw[seven] = raw[seven], raw[three]
    cand = tmp_path / "swapped.gguf"
    cand.write_bytes(bytes(raw))
    r = compare(ref, cand)
    router = _by_name(r)["blk.0.ffn_gate_inp.weight"]
    assert cast(float, router.metrics.correlation) > 0.99
    assert 0.05 < cast(float, router.metrics.rel_error) < 0.12
    assert [t.name for t in r.tensors if not t.ok] == ["blk.0.ffn_gate_inp.weight"]
    (why,) = router.failures
    assert why.startswith("2 of 512 expert slices differ by more than their own values")
    assert "expert 3: 1." in why and "expert 7: 1." in why
    code, _out, err = run_cli(capsys, "compare", ref, cand, "-q")
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "'blk.0.ffn_gate_inp.weight': 2 of 512" in lines[0]
