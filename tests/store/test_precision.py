"""Per-expert precision: plans from real traces under a budget, requantisation through ggml's
own quantisers (checked against llama.cpp's llama-quantize output), verify, bad plans."""

from __future__ import annotations

import itertools
import json
from typing import cast

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.synth import synth_model
from moepack.cli.main import main
from moepack.errors import BadInput
from moepack.layout.plan import LayerPlan, Plan
from moepack.store import open_store
from moepack.store.build import build_store
from moepack.store.precision_apply import PlanRequantiser
from moepack.store.precision_plan import (
    PrecisionPlan,
    bits_per_weight,
    load_precision_plan,
    make_precision_plan,
    save_precision_plan,
)
from moepack.store.verify import verify_store
from moepack.trace import load_trace
from quantfixtures import FTYPES, HAVE_GGML, f32_model, llama_quantise

pytestmark = pytest.mark.skipif(not HAVE_GGML, reason="llama-cpp-python (libggml-base) missing")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A Q8_0 model with rows of 256 values (K-quants fit) and its skewed planted routing."""
    folder = tmp_path_factory.mktemp("precision")
    model, trace = folder / "m.gguf", folder / "t.moetrace"
    options = "--hidden 256 --expert-ffn 256 --experts 8 --top-k 2 --layers 2 --weight-type Q8_0"
    with pytest.raises(SystemExit) as done:
        main(
            ["synth", "--out", str(model), "--trace-out", str(trace), *options.split()]
            + ["--routing", "skew=1.5", "-q"]
        )
    assert done.value.code in (0, None)
    return model, trace


def plan_for(pair, **kw) -> PrecisionPlan:
    model, trace = pair
    with MoeModel(model) as m:
        return make_precision_plan(m, load_trace(trace, model=m), **kw)


def test_hot_experts_get_more_bits_within_the_budget(pair):
    model, _ = pair
    plans = [plan_for(pair, budget_fraction=f) for f in (0.45, 0.6, 0.8)]
    for plan in plans:
        assert plan.planned_bytes <= plan.budget_bytes < plan.source_bytes
        for b, row in plan.blocks.items():
            counts = plan.counts[b]
            bits = [bits_per_weight(t) if t is not None else 8.5 for t in row]
            hot, cold = int(np.argmax(counts)), int(np.argmin(counts))
            assert bits[hot] >= bits[cold]
            for i, j in itertools.permutations(range(len(row)), 2):
                if counts[i] > counts[j]:  # a hotter expert never has fewer bits
                    assert bits[i] >= bits[j], (b, i, j)
    saved = [p.source_bytes - p.planned_bytes for p in plans]
    assert saved[0] > saved[1] > saved[2] > 0  # more budget, fewer bytes saved


def test_store_holds_each_expert_at_its_type_and_verifies(tmp_path, pair):
    model, _ = pair
    plan = plan_for(pair, budget_fraction=0.6)
    save_precision_plan(plan, tmp_path / "p.moeprec")
    loaded = load_precision_plan(tmp_path / "p.moeprec")
    assert loaded.blocks == plan.blocks and loaded.budget_bytes == plan.budget_bytes
    res = build_store(model, tmp_path / "s.moestore", requantiser=PlanRequantiser(loaded))
    assert res.payload_bytes == plan.planned_bytes
    # the free-space estimate covers the store, off by the errors' digits only
    real = (tmp_path / "s.moestore").stat().st_size
    p = res.precision
    assert p is not None
    assert res.store_bytes == real <= res.estimated_bytes <= real + 300 * len(p["experts"]) + 64
    assert p["bytes_saved"] == plan.source_bytes - plan.planned_bytes > 0
    assert set(p["quantisers"].values()) == {"ggml"}  # K-quants: gguf-py has no quantiser
    with open_store(tmp_path / "s.moestore") as s:
        for b in s.blocks:
            for rec in s.experts(b):
                want = plan.target(b, rec.expert)
                types = {part.ggml_type for part in rec.parts}
                assert types == {want if want is not None else int(T.Q8_0)}
    errors = {(e["block"], e["expert"]): e["metrics"] for e in p["experts"]}
    for (b, e), m in errors.items():
        assert 0.99 < m["correlation"] < 1.0 and 0 < m["rel_error"] < 0.2, (b, e)
    # fewer bits, larger error: compare a Q3_K/Q4_K expert with a Q6_K one if both exist
    by_bits = sorted(
        (
            (bits_per_weight(cast(int, plan.target(b, e))), m["rel_error"])
            for (b, e), m in errors.items()
        ),
    )
    assert by_bits[0][1] >= by_bits[-1][1]
    assert verify_store(tmp_path / "s.moestore", model).ok


def test_a_corrupted_requantised_slice_is_named(tmp_path, pair):
    model, _ = pair
    plan = plan_for(pair, budget_fraction=0.5)
    build_store(model, tmp_path / "s.moestore", requantiser=PlanRequantiser(plan))
    with open_store(tmp_path / "s.moestore") as s:
        rec = next(r for r in s.experts(1) if plan.target(1, r.expert) is not None)
        part = rec.parts[1]
    data = bytearray((tmp_path / "s.moestore").read_bytes())
    data[part.offset + 3] ^= 1
    (tmp_path / "bad.moestore").write_bytes(bytes(data))
    r = verify_store(tmp_path / "bad.moestore", model)
    assert not r.ok and r.first is not None
    assert (r.first.block, r.first.expert, r.first.part) == (1, rec.expert, "up")
    assert "requantised to" in r.first.message


def test_requantised_k_quants_equal_llama_quantize_bytes(tmp_path):
    """F32 -> Q6_K / Q4_K per expert through ggml_quantize_chunk is byte for byte what
    llama.cpp's own llama-quantize writes for the same tensors (no importance matrix)."""
    source = f32_model(tmp_path)
    with MoeModel(source) as m:
        fp = m.fingerprint
        blocks = {b.index: b.n_expert for b in m.blocks}
    for ftype_name in ("Q6_K", "Q4_K_M"):
        ftype, expert_type = FTYPES[ftype_name]
        quantised = tmp_path / f"{ftype_name}.gguf"
        proc = llama_quantise(source, quantised, ftype)
        assert proc.returncode == 0, proc.stderr[-500:]
        target = int(T[expert_type])
        plan = PrecisionPlan(fp, 1 << 40, {b: [target] * n for b, n in blocks.items()})
        store = tmp_path / f"{ftype_name}.moestore"
        build_store(source, store, requantiser=PlanRequantiser(plan))
        compared = 0
        with open_store(store) as s, MoeModel(quantised) as q:
            for b in s.blocks:
                sources = s.block_index(b).sources
                for rec in s.experts(b):
                    data = s.read_record(rec)
                    for part, src in zip(rec.parts, sources, strict=True):
                        theirs = q.tensors[src.tensor]
                        if int(theirs.ggml_type) != part.ggml_type:
                            continue  # llama.cpp's mix chose another type for this tensor
                        slice_bytes = theirs.n_bytes // s.block_index(b).n_expert
                        raw = q.shards[0].reader.data
                        start = theirs.offset + rec.expert * slice_bytes
                        lo = part.offset - rec.offset
                        assert data[lo : lo + part.size] == bytes(raw[start : start + slice_bytes])
                        compared += 1
        assert compared >= 4, ftype_name


def test_bad_precision_plans(tmp_path, pair, capsys):
    model, trace = pair
    plan = plan_for(pair, budget_fraction=0.6)
    over = PrecisionPlan(
        plan.model_fingerprint, plan.planned_bytes - 1, plan.blocks, path=tmp_path / "o.moeprec"
    )
    save_precision_plan(over, tmp_path / "o.moeprec")
    store, over_path = tmp_path / "s.moestore", tmp_path / "o.moeprec"
    code, _, err = run_cli(
        capsys, "store", "build", model, "--out", store, "--precision", over_path
    )
    assert code == 2 and "over budget" in err and not store.exists()
    other = synth_model(tmp_path / "x.gguf", tiny_spec(hidden=256, expert_ffn=256)).paths[0]
    with pytest.raises(BadInput, match="precision plan is for the model with fingerprint"):
        build_store(other, tmp_path / "x.moestore", requantiser=PlanRequantiser(plan))
    with pytest.raises(BadInput, match="below the smallest store"):
        plan_for(pair, budget_bytes=1000)
    precision = ["store", "precision", model, "--trace", trace, "--budget"]
    code, out, err = run_cli(capsys, *precision, "70%", "--out", tmp_path / "c.moeprec", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["planned_bytes"] <= doc["budget_bytes"] and doc["bytes_saved"] > 0
    code, _, err = run_cli(capsys, *precision, "0%", "--out", tmp_path / "d.moeprec")
    assert code == 2 and "--budget" in err
    (tmp_path / "e.moeprec").write_text('{"format": "moepack-precision", "version": 1}')
    with pytest.raises(BadInput, match="model_fingerprint is missing"):
        load_precision_plan(tmp_path / "e.moeprec")


def test_precision_and_plan_together(tmp_path, pair):
    model, _ = pair
    precision = plan_for(pair, budget_fraction=0.55)
    with MoeModel(model) as m:
        rng = np.random.default_rng(2)
        order = Plan([LayerPlan(b.index, rng.permutation(b.n_expert)) for b in m.blocks])
    out = tmp_path / "s.moestore"
    build_store(model, out, plan=order, requantiser=PlanRequantiser(precision))
    with open_store(out) as s:
        for b in s.blocks:
            recs = s.experts(b)
            perm = order.perm_for(b)
            assert perm is not None
            assert [r.expert for r in recs] == perm.tolist()
            ends = [r.offset + r.size for r in recs]
            assert all(e == nxt.offset for e, nxt in zip(ends, recs[1:], strict=False))
    assert verify_store(out, model).ok
