"""``trace stats`` on traces whose structure is known: the metrics come out as planted."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import cast

import numpy as np
import pytest

from moefixtures import run_cli
from moepack.errors import BadInput
from moepack.trace import RoutingTrace, TraceStructure, save_trace, synth_trace, synth_truth
from moepack.trace.routing_stats import lift, routing_stats
from moepack.trace.stats import coactivation


def test_reuse_at_lag_one_is_the_planted_persistence() -> None:
    for planted in (0.2, 0.6):
        trace = synth_trace(
            tokens=20_000,
            layers=3,
            n_expert=64,
            top_k=4,
            prefill_tokens=500,
            seed=3,
            structure=TraceStructure(persistence=planted),
        )
        decode = routing_stats(trace).phases["decode"]
        for layer in decode.layers:
            assert layer.reuse[0] == pytest.approx(planted, abs=0.02)
            assert layer.reuse[-1] > trace.k / trace.n_expert  # topics persist further
            assert layer.reuse[0] > layer.reuse[-1]


def test_lift_above_2x_picks_out_the_planted_clusters() -> None:
    trace = synth_trace(
        tokens=30_000,
        layers=2,
        n_expert=64,
        top_k=4,
        seed=4,
        structure=TraceStructure(clusters=8, locality=0.95),
    )
    truth = synth_truth(trace)
    assert truth is not None
    stats = routing_stats(trace).phases["all"]
    n = trace.n_expert
    for layer in range(trace.layers):
        cl = truth.cluster_of[layer]
        iu = np.triu_indices(n, 1)
        within = cl[iu[0]] == cl[iu[1]]
        # the pairs above 2x are the within-cluster pairs
        assert stats.layers[layer].lift_above_2x == pytest.approx(within.mean(), abs=0.01)
        both = coactivation(trace, layer)
        counts = np.bincount(np.asarray(trace.ids[:, layer, :]).ravel(), minlength=n)
        ratio = both[iu] * trace.tokens / (counts[iu[0]] * counts[iu[1]])
        assert (within[ratio > 2]).mean() > 0.99
        assert stats.layers[layer].lift_p99 > 2


def test_uniform_routing_has_no_structure() -> None:
    trace = synth_trace(
        tokens=20_000,
        layers=2,
        n_expert=32,
        top_k=2,
        seed=6,
        structure=TraceStructure(clusters=1, locality=0.0, persistence=0.0, layer_coupling=0.0),
    )
    for s in routing_stats(trace).phases["all"].layers:
        assert s.entropy == pytest.approx(1.0, abs=0.005)
        assert s.hot10_share == pytest.approx(4 / 32, abs=0.01)  # ceil(3.2) = 4 experts
        assert s.reuse[0] == pytest.approx(0.0, abs=1e-9)  # planted: fresh outside the set
        assert s.lift_above_2x == 0.0


def test_popularity_of_a_planted_skew() -> None:
    rng = np.random.default_rng(7)
    n = 50
    p = 1 / np.arange(1, n + 1) ** 1.1
    p /= p.sum()
    ids = rng.choice(n, size=(100_000, 1, 1), p=p).astype(np.uint8)
    s = routing_stats(RoutingTrace(ids=ids, n_expert=n)).phases["all"].layers[0]
    assert s.entropy_bits == pytest.approx(float(-(p * np.log2(p)).sum()), abs=0.01)
    assert s.hot10_share == pytest.approx(float(p[:5].sum()), abs=0.005)
    assert s.experts_for["90%"] == int(np.searchsorted(np.cumsum(p), 0.9) + 1)


def test_layer_coupling_makes_the_next_layer_predictable() -> None:
    def best_map(coupling: float) -> tuple[float, float, float]:
        trace = synth_trace(
            tokens=20_000,
            layers=3,
            n_expert=32,
            top_k=2,
            seed=8,
            structure=TraceStructure(
                clusters=4,
                locality=0.95,
                persistence=0.0,
                cluster_persistence=0.5,
                layer_coupling=coupling,
            ),
        )
        ph = routing_stats(trace).phases["all"]
        return ph.mean("next_best_map"), ph.mean("next_baseline"), ph.mean("next_mi_bits")

    coupled, base_c, mi_c = best_map(0.95)
    free, base_f, mi_f = best_map(0.0)
    assert coupled > 2 * free
    assert mi_c > 5 * mi_f
    assert free < 1.5 * base_f  # no coupling: no better than the best constant guess
    assert coupled > 2 * base_c


def test_lift_is_nan_without_two_used_experts() -> None:
    both = np.zeros((4, 4), dtype=np.int64)
    out = lift(both, np.array([5, 0, 0, 0]), 5)
    assert all(math.isnan(cast(float, v)) for v in out.values())


def test_trace_without_prefill_reports_one_phase_and_json_is_valid(tmp_path: Path) -> None:
    trace = synth_trace(tokens=50, layers=2, n_expert=8, top_k=2, seed=1)
    stats = routing_stats(trace)
    assert list(stats.phases) == ["all"]
    text = json.dumps(stats.to_json(), allow_nan=False)
    back = json.loads(text)
    assert len(back["phases"]["all"]["layers"][0]["lru_hit_rate"]) == 8
    assert back["phases"]["all"]["layers"][1]["next_best_map"] is None


def test_cli_table_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = synth_trace(tokens=2000, layers=2, n_expert=16, top_k=2, prefill_tokens=100, seed=2)
    path = tmp_path / "t.moetrace"
    save_trace(trace, path)
    code, out, err = run_cli(capsys, "trace", "stats", path, "--json", "--plot", tmp_path / "p")
    assert code == 0, err
    doc = json.loads(out)
    assert set(doc["phases"]) == {"all", "decode"}
    assert doc["phases"]["decode"]["tokens"] == 1900
    names = sorted(p.name for p in (tmp_path / "p").iterdir())
    assert names == ["coactivation-layer0.png", "lru-hit-rate.png", "popularity.png", "reuse.png"]
    assert all((tmp_path / "p" / n).read_bytes()[:4] == b"\x89PNG" for n in names)
    code, out, err = run_cli(capsys, "trace", "stats", path)
    assert code == 0 and "decode tokens (1,900)" in out and "LRU@2" in out


def test_cli_bad_input_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = synth_trace(tokens=200, layers=2, n_expert=16, top_k=2, seed=2)
    path = tmp_path / "t.moetrace"
    save_trace(trace, path)
    code, _, err = run_cli(
        capsys, "trace", "stats", path, "--plot", tmp_path / "p", "--heatmap-layer", 5
    )
    assert code == 2 and "heatmap layer 5 does not exist" in err
    assert not (tmp_path / "p").exists()
    (tmp_path / "file").write_text("x")
    code, _, err = run_cli(capsys, "trace", "stats", path, "--plot", tmp_path / "file")
    assert code == 2 and err.startswith("moepack: error:")
    code, _, err = run_cli(capsys, "trace", "stats", tmp_path / "file")
    assert code == 2 and "moepack: error:" in err
    with pytest.raises(BadInput):
        from moepack.trace.routing_stats import trace_stats

        trace_stats(path, plot_dir=tmp_path / "missing" / "deeper")
    assert not (tmp_path / "missing").exists()


def test_stats_against_a_model_label_layers_with_blocks(
    tmp_path: Path, model_path: Path, other_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from moepack.checkpoint import MoeModel

    with MoeModel(model_path) as m:
        trace = synth_trace(m, tokens=300, seed=3)
        blocks = m.moe_block_indices
    path = tmp_path / "t.moetrace"
    save_trace(trace, path)
    code, out, err = run_cli(capsys, "trace", "stats", path, "--model", model_path, "--json")
    assert code == 0, err
    assert [s["block"] for s in json.loads(out)["phases"]["all"]["layers"]] == blocks
    code, _, err = run_cli(capsys, "trace", "stats", path, "--model", other_model_path)
    assert code == 2 and "moepack: error:" in err


def test_cli_says_which_option_supplies_the_expert_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.txt"
    path.write_text("0 0 1 2\n1 0 2 3\n")  # text form without an n_expert declaration
    code, _, err = run_cli(capsys, "trace", "stats", path)
    assert code == 2 and "--n-expert N or --model MODEL" in err
    code, out, err = run_cli(capsys, "trace", "stats", path, "--n-expert", 4, "--json")
    assert code == 0, err
    assert json.loads(out)["n_expert"] == 4


def test_pair_statistics_are_the_same_dense_and_sparse() -> None:
    """Beyond ``DENSE_EXPERTS`` the pair counts are sparse: the same ids declared among 64
    and among 4,096 experts give the same lift, layer-to-layer numbers, reuse and LRU curve."""
    small = synth_trace(tokens=3000, layers=3, n_expert=64, top_k=4, prefill_tokens=200, seed=5)
    wide = RoutingTrace(
        ids=np.asarray(small.ids).astype(np.uint16), n_expert=4096, prefill_tokens=200
    )
    for ph in ("all", "decode"):
        a, b = routing_stats(small).phases[ph], routing_stats(wide).phases[ph]
        for x, y in zip(a.layers, b.layers, strict=True):
            for name in ("lift_above_2x", "lift_p90", "lift_p99", "next_mi_bits",
                         "next_best_map", "next_baseline"):  # fmt: skip
                want = getattr(x, name)  # None at the last layer (no next one)
                assert getattr(y, name) == (want if want is None else pytest.approx(want, rel=1e-9))
            assert y.reuse == pytest.approx(x.reuse, rel=1e-12)
            assert y.lru_hit_rate[:64] == pytest.approx(x.lru_hit_rate, rel=1e-12)


def test_lift_counts_the_pairs_never_chosen_together() -> None:
    """The sparse lift (zeros counted, not held) equals the dense formula over every pair."""
    trace = synth_trace(tokens=400, layers=1, n_expert=48, top_k=3, seed=9)
    both = coactivation(trace, 0)
    counts = np.bincount(np.asarray(trace.ids[:, 0, :]).ravel(), minlength=48)
    used = np.flatnonzero(counts > 0)
    iu = np.triu_indices(used.size, 1)
    a, b = used[iu[0]], used[iu[1]]
    ratio = both[a, b] * float(trace.tokens) / (counts[a].astype(np.float64) * counts[b])
    assert (ratio == 0).any()  # the case in question is there
    out = lift(both, counts, trace.tokens)
    assert out["lift_above_2x"] == pytest.approx(float((ratio > 2).mean()))
    assert out["lift_p90"] == pytest.approx(float(np.percentile(ratio, 90)))
    assert out["lift_p99"] == pytest.approx(float(np.percentile(ratio, 99)))


def test_reuse_in_chunks_equals_reuse_of_the_whole_layer() -> None:
    from moepack.trace.routing_stats import reuse_in_runs, reuse_of_ids
    from moepack.trace.stackdist import token_masks

    trace = synth_trace(tokens=500, layers=1, n_expert=200, top_k=4, seed=2)
    ids = np.asarray(trace.ids[:, 0, :])
    runs = [slice(0, 37), slice(37, 260), slice(260, 500)]
    whole = reuse_in_runs(token_masks(ids, 200), runs, 4)
    for words in (1, 40, 1 << 20):  # chunks of 9, 10 and all tokens
        assert reuse_of_ids(ids, runs, 4, 200, mask_words=words) == pytest.approx(whole)


@pytest.mark.parametrize("n_expert", [512, 8192, 65536])
def test_trace_stats_memory_follows_the_trace_not_the_declared_experts(
    tmp_path: Path, n_expert: int
) -> None:
    """A 3 KB .pmxtrace declaring 8,192 experts peaked at 4.2 GB (65,536: 32 GiB asked of
    numpy). Now every declared count up to the format's limit runs within 1.5 GiB of address
    space (the interpreter, numpy and matplotlib take most of it), plots included."""
    import subprocess
    import sys

    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(n_expert, size=(2, 4), replace=False) for _ in range(100)])
    path = tmp_path / "t.pmxtrace"
    save_trace(RoutingTrace(ids=ids.astype(np.uint32), n_expert=n_expert, prefill_tokens=20),
               path)  # fmt: skip
    code = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 29, 3 << 29)); "
        "from moepack.cli.main import main; main(sys.argv[1:])"
    )
    args = ["trace", "stats", str(path), "--json", "--plot", str(tmp_path / "p")]
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert len(doc["phases"]["decode"]["layers"][0]["lru_hit_rate"]) == n_expert
    assert len(list((tmp_path / "p").iterdir())) == 4
