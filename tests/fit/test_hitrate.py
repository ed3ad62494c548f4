"""Hit rates for ``fit``: the live cache's from a trace equal an LRU run of the trace, the
page cache's faults equal an LRU of fault windows, and the priors bound a range."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from moefixtures import tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.synth import synth_model
from moepack.errors import BadInput
from moepack.fit.hitrate import RECENCY_EXPONENT, HitModel, _window_distances, bound_trace
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


def _lru_faults(stream: list[int], capacity: int, counted: list[bool]) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    misses = 0
    for w, count in zip(stream, counted, strict=True):
        if w in cache:
            cache.move_to_end(w)
        else:
            misses += count
            cache[w] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return misses


def test_window_distances_are_lru() -> None:
    rng = np.random.default_rng(3)
    stream = rng.integers(0, 40, size=3000)
    d = _window_distances(stream)
    for capacity in (1, 5, 17, 40):
        hits = int(np.count_nonzero((d >= 0) & (d < capacity)))
        assert len(stream) - hits == _lru_faults(stream.tolist(), capacity, [True] * len(stream))


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


def test_page_cache_from_trace_is_an_lru_of_windows(model_path: Path) -> None:
    with MoeModel(model_path) as m:
        shape = model_shape(m)
        trace = synth_trace(m, tokens=300, prefill_tokens=100, seed=2)
        hits = HitModel(shape, trace, m)
        window = 16384
        stream, counted = [], []
        decode = trace.phase_mask("decode")
        ids = np.asarray(trace.ids)
        for t in range(ids.shape[0]):
            for layer, block in enumerate(m.blocks):
                for tensor in block.weight_tensors:
                    for e in ids[t, layer]:
                        off = tensor.slice_offset(int(e))
                        for w in range(off // window, (off + tensor.slice_bytes - 1) // window + 1):
                            stream.append((tensor.shard << 48) + w)
                            counted.append(bool(decode[t]))
        for cache in (window * 8, window * 64, shape.expert_bytes // 2):
            few, many = hits.page_cache(cache, window)
            want = _lru_faults(stream, cache // window, counted) / decode.sum()
            assert few == many == pytest.approx(want)
        assert hits.page_cache(shape.expert_bytes, window) == (0.0, 0.0)


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
