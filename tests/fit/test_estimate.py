"""The cost model's arithmetic on a small generated model: a model that fits costs its
compute; one that does not pays its misses at the measured bandwidth and fault cost; more
memory is never slower; the knee and the other sizes sit where they say.

The compute figures here are a ``Calibration`` written out by hand (what the llama.cpp
calibration returns, tested in ``test_cli_fit``), so the formulas are checked exactly."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from moefixtures import tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.synth import synth_model
from moepack.fit.calibrate import (
    CACHE_MULTIPLE,
    DEEPEST,
    Calibration,
    ThreadTimes,
    calibration_depths,
    last_level_cache,
)
from moepack.fit.device import StorageProfile, measure_storage
from moepack.fit.estimate import KNEE_SHARE, QUEUE_DEPTH, CostModel, other_sizes
from moepack.fit.hitrate import HitModel
from moepack.fit.shapes import ModelShape, model_shape
from moepack.trace import synth_trace

TINY = dict(sizes=[64 << 10, 256 << 10, 1 << 20], depths=[1, 8], cell_seconds=0.02,
            repeats=1, fault_slices=4)  # fmt: skip


# a 27 MB model: the prefetcher's 96 MiB margin and llama.cpp's own memory scaled down with it
SMALL = dict(margin=1 << 20, process_bytes=2 << 20)


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelShape, StorageProfile, Path]:
    d = tmp_path_factory.mktemp("est")
    path = d / "m.gguf"
    synth_model(path, tiny_spec(layers=4, experts=32, top_k=4, hidden=256, expert_ffn=256,
                                weight_type="Q8_0"))  # fmt: skip
    data = d / "data.bin"
    data.write_bytes(os.urandom(16 << 20))
    storage = measure_storage(data, **TINY)  # type: ignore[arg-type]
    with MoeModel(path) as m:
        return model_shape(m), storage, path


def _calibration(decode: float = 0.010) -> Calibration:
    t1 = ThreadTimes(1, decode / 5, decode / 5, 0.002, 0.0005)
    t2 = ThreadTimes(2, decode / 8, decode / 8, 0.001, 0.0003)
    return Calibration("k", {"arch": "qwen3moe", "weight_type": "Q8_0"}, [], 8, 32, 1e5,
                       0, [t1, t2], "test", "cpu", "now")  # fmt: skip


def test_fits_costs_compute_only(parts: tuple[ModelShape, StorageProfile, Path]) -> None:
    shape, storage, path = parts
    with MoeModel(path) as m:
        cost = CostModel(shape, _calibration(), storage, HitModel(shape, None, m), **SMALL)
    p = cost.point(cost.fit_memory, [1, 2])
    assert p.fits and p.verdict == "fits"
    c2 = _calibration().decode_seconds(shape, 2)
    assert p.stock.threads == 2 and p.stock.decode_tps == (1 / c2, 1 / c2)
    assert p.prefetch.decode_tps == p.stock.decode_tps and p.stock.limiter == "CPU"
    assert p.stock.read_per_token == (0.0, 0.0)


def test_streaming_pays_misses(parts: tuple[ModelShape, StorageProfile, Path]) -> None:
    shape, storage, path = parts
    with MoeModel(path) as m:
        cost = CostModel(shape, _calibration(), storage, HitModel(shape, None, m), **SMALL)
    memory = (cost.min_memory + cost.fit_memory) // 2
    e = cost.prefetch(memory, 1)
    slots = cost.slots(cost.cache_budget(memory))
    assert shape.top_k <= slots < shape.n_expert
    assert e.hit is not None and e.hit.low == pytest.approx(slots / shape.n_expert)
    need = shape.moe_layers * shape.top_k * shape.bytes_per_expert
    assert e.read_per_token[1] == pytest.approx(need * (1 - e.hit.low))
    bw = storage.bandwidth(shape.bytes_per_expert // 3, QUEUE_DEPTH)
    c = _calibration().decode_seconds(shape, 1)
    assert e.decode_tps[0] == pytest.approx(1 / (c + need * (1 - e.hit.low) / bw))
    assert e.decode_tps[0] <= e.decode_tps[1] <= e.bound_tps
    s = cost.stock(memory, 1)
    assert s.faults is not None and 0 < s.faults[0] <= s.faults[1]
    cell = storage.fault(shape.bytes_per_expert // 3)
    assert s.io_s[1] == pytest.approx(s.faults[1] * cell.seconds)
    p = cost.point(memory, [1, 2])
    assert not p.fits and p.verdict in ("streams", "too slow")
    assert p.settings["prefetch"] is True and p.settings["cache"] == p.cache_bytes


def test_more_memory_never_slower(parts: tuple[ModelShape, StorageProfile, Path]) -> None:
    shape, storage, path = parts
    with MoeModel(path) as m:
        trace = synth_trace(m, tokens=400, prefill_tokens=100, seed=4)
        for hits in (HitModel(shape, None, m), HitModel(shape, trace, m)):
            cost = CostModel(shape, _calibration(), storage, hits, **SMALL)
            lo, hi = cost.min_memory, cost.fit_memory
            sizes = [lo + (hi - lo) * i // 10 for i in range(11)]
            pre = [cost.prefetch(x, 1).decode_tps for x in sizes]
            stock = [cost.stock(x, 1).decode_tps for x in sizes]
            # the kernel's lists are not monotone in memory (the inactive share steps at
            # each GB; more room can keep a thrashing pattern going longer): stock within 15 %
            for seq, slack in ((pre, 0.999), (stock, 0.85)):
                for a, b in zip(seq, seq[1:], strict=False):
                    assert b[0] >= a[0] * slack and b[1] >= a[1] * slack
            knee = cost.knee([1, 2])
            best = knee["best_tps"]
            for end, idx in (("low", 0), ("high", 1)):
                assert lo <= knee[end] <= hi
                if knee[end] < hi:
                    assert cost.prefetch(knee[end], 2).decode_tps[idx] >= KNEE_SHARE * best
            if hits.source == "trace":
                assert knee["low"] == knee["high"]
            others = other_sizes((lo + hi) // 2, cost)
            assert len(others) == 2 and all(lo <= x <= hi for x in others)


def test_too_little_memory_says_memory(parts: tuple[ModelShape, StorageProfile, Path]) -> None:
    shape, storage, path = parts
    with MoeModel(path) as m:
        cost = CostModel(shape, _calibration(), storage, HitModel(shape, None, m), **SMALL)
    e = cost.prefetch(cost.overhead, 1)
    assert e.limiter == "memory"
    p = cost.point(cost.overhead, [1])
    assert p.settings["cache"] is None


def test_the_deep_calibration_model_is_timed_from_memory_not_the_cpu_cache(
    parts: tuple[ModelShape, StorageProfile, Path],
) -> None:
    shape = parts[0]
    big = dataclasses.replace(
        shape,
        file_bytes=(100 << 30) + shape.dense_bytes,
        expert_bytes=100 << 30,
        bytes_per_expert=2 << 20,
    )
    experts = min(big.n_expert, max(2 * big.top_k, 8))
    layer = experts * big.bytes_per_expert + big.dense_bytes / big.blocks
    llc = 96 << 20
    shallow, deep = calibration_depths(big, llc)
    assert shallow < deep <= DEEPEST
    assert deep * layer >= CACHE_MULTIPLE * llc or deep == DEEPEST
    assert (deep - 1) * layer < CACHE_MULTIPLE * llc  # no deeper than it needs
    # a model smaller than the cache multiple: the calibration is about as big as it, no more
    _, small = calibration_depths(shape, llc)
    little = experts * shape.bytes_per_expert + shape.dense_bytes / shape.blocks
    assert small == shallow + 2 or (small - 1) * little < shape.file_bytes
    assert last_level_cache() > 0
