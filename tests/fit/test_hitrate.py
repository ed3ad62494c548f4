"""Hit rates for ``fit``: the live cache's from a trace equal an LRU run of the trace, the
page cache's faults follow the routing, and the priors bound a range."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moefixtures import tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.synth import synth_model
from moepack.errors import BadInput
from moepack.fit.hitrate import RECENCY_EXPONENT, HitModel, bound_trace
from moepack.fit.shapes import model_shape
from moepack.stream.simulate import layer_hits
from moepack.trace import synth_trace
from moepack.trace.cache_policy import POLICIES
from moepack.trace.formats import save_trace


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hit") / "m.gguf"
    synth_model(path, tiny_spec(layers=3, experts=16, top_k=2, weight_type="Q8_0"))
    return path


def test_live_cache_from_trace_is_lru(model_path: Path) -> None:
    with MoeModel(model_path) as m:
        shape = model_shape(m)
        trace = synth_trace(m, tokens=600, prefill_tokens=200, seed=1)
        hits = HitModel(shape, trace, m)
        ids = np.asarray(trace.ids)
        decode = trace.phase_mask("decode")
        for slots in (2, 5, 9, 16):
            want = np.mean(
                [
                    layer_hits(POLICIES.get("lru"), ids[:, layer], slots, 16)[decode].mean()
                    for layer in range(ids.shape[1])
                ]
            )
            got = hits.live_cache(slots)
            assert got.low == got.high == pytest.approx(want)


def test_stock_faults_follow_the_routing(tmp_path: Path) -> None:
    path = tmp_path / "wide.gguf"  # slices of ~280 KiB: a couple of replay units each
    synth_model(path, tiny_spec(layers=3, experts=16, top_k=2, hidden=1024, expert_ffn=256,
                                weight_type="Q8_0"))  # fmt: skip
    window = 1 << 20
    with MoeModel(path) as m:
        shape = model_shape(m)
        spread = synth_trace(m, tokens=200, prefill_tokens=50, seed=4)
        hot_ids = np.zeros_like(np.asarray(spread.ids))
        hot_ids[..., 1] = 1  # every token routes to experts 0 and 1 in every layer
        hot = spread.replace(ids=hot_ids)
        small = shape.expert_bytes // 2
        f_spread = HitModel(shape, spread, m).page_cache(small, window)
        f_hot = HitModel(shape, hot, m).page_cache(small, window)
        assert f_spread[0] == f_spread[1] > 0  # a trace: one number, and it streams
        assert f_hot == (0.0, 0.0)  # two experts a layer stay in half of them
        assert HitModel(shape, spread, m).page_cache(shape.expert_bytes, window) == (0.0, 0.0)


def test_priors_are_a_range(model_path: Path) -> None:
    with MoeModel(model_path) as m:
        shape = model_shape(m)
        hits = HitModel(shape, None, m)
    assert hits.source == "priors"
    for slots in (2, 4, 8, 16):
        r = hits.live_cache(slots)
        assert r.low == pytest.approx(slots / 16)  # uniform routing: the floor
        assert r.high == pytest.approx((slots / 16) ** RECENCY_EXPONENT)
        assert r.low <= r.high <= 1
    few, many = hits.page_cache(shape.expert_bytes // 4, 4096)
    assert 0 < few < many
    assert hits.page_cache(shape.expert_bytes, 4096) == (0.0, 0.0)


def test_trace_bound_by_shape(model_path: Path, tmp_path: Path) -> None:
    with MoeModel(model_path) as m:
        shape = model_shape(m)
        good = tmp_path / "good.moetrace"
        save_trace(synth_trace(m, tokens=50), good)
        assert bound_trace(good, m, shape).tokens == 50
        other = tmp_path / "other.moetrace"
        save_trace(synth_trace(layers=3, n_expert=16, top_k=4, tokens=50), other)
        with pytest.raises(BadInput, match="top-2") as e:
            bound_trace(other, m, shape)
        assert str(other) in str(e.value)


def test_a_prompt_touches_what_the_trace_s_prompts_touched(model_path: Path) -> None:
    """A prompt's distinct experts per layer: the trace's prompts of that length where it has
    them (here every token routes to two experts: two), uniform routing otherwise."""
    with MoeModel(model_path) as m:
        shape = model_shape(m)
        spread = synth_trace(m, tokens=200, prefill_tokens=50, seed=4)
        ids = np.zeros_like(np.asarray(spread.ids))
        ids[..., 1] = 1
        hot = HitModel(shape, spread.replace(ids=ids), m)
        assert hot.touched(40) == 2.0
        uniform = 16 * (1 - (1 - 2 / 16) ** 80)
        assert hot.touched(80) == pytest.approx(uniform)  # no prompt of the trace that long
        assert HitModel(shape, None, m).touched(40) == pytest.approx(16 * (1 - (7 / 8) ** 40))
