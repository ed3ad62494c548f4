"""The cost model's arithmetic on a small generated model, for the run ``run`` itself chooses
(``fit.runchoice``, run's own code): a model that fits costs its compute; one that does not
streams through the pager's budget, its misses read at the direct bandwidth beside the
compute; the tuner's choice is the one run's tuner makes from those pass times; more memory
is never slower; a memory run would refuse is a refusal; the knee and the other sizes sit
where they say.

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
from moepack.errors import BadInput
from moepack.fit.calibrate import (
    CACHE_MULTIPLE,
    DEEPEST,
    MAPPED,
    Calibration,
    ThreadTimes,
    calibration_depths,
    last_level_cache,
)
from moepack.fit.device import StorageProfile, measure_storage
from moepack.fit.estimate import (
    KNEE_SHARE,
    LOOKAHEAD_WASTE,
    QUEUE_DEPTH,
    CostModel,
    knee,
    other_sizes,
    tuned,
)
from moepack.fit.hitrate import HitModel
from moepack.fit.overlap import DEFAULT, Overlap, fitted_share, overlapped
from moepack.fit.runchoice import RunChooser
from moepack.fit.shapes import ModelShape, model_shape
from moepack.llama.runtime.choice import AutoStream, choose_streaming, pager_works
from moepack.llama.runtime.memory_plan import memory_for_experts
from moepack.llama.runtime.run import cores
from moepack.llama.runtime.threadtune import ThreadTuner
from moepack.serve.prefixcache import budget_bytes
from moepack.serve.server import ServeOptions
from moepack.trace import synth_trace

TINY = dict(sizes=[64 << 10, 256 << 10, 1 << 20], depths=[1, 8], cell_seconds=0.02,
            repeats=1, fault_slices=4)  # fmt: skip
GIB = 1 << 30
LOTS = 64 * GIB  # a machine the model fits in


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


def _cost(parts: tuple[ModelShape, StorageProfile, Path], m: MoeModel) -> CostModel:
    shape, storage, _path = parts
    return CostModel(shape, _calibration(), storage, HitModel(shape, None, m), DEFAULT, cores())


def _half(path: Path) -> int:
    with MoeModel(path) as m:
        return memory_for_experts(path, m.expert_bytes // 2, n_ctx=4096)


def test_fits_costs_compute_only(parts: tuple[ModelShape, StorageProfile, Path]) -> None:
    shape, _storage, path = parts
    with MoeModel(path) as m:
        cost = _cost(parts, m)
    ch = RunChooser(path, available=LOTS).choose()
    assert ch.engine == "llama.cpp" and ch.tune is None and ch.threads == cores()
    p = cost.point(ch)
    assert p.fits and p.verdict == "fits"
    c = _calibration().decode_seconds(shape, ch.threads)
    assert p.run.decode_tps == (1 / c, 1 / c) == p.run.run_decode_tps
    assert p.stock.decode_tps == p.run.decode_tps and p.run.limiter == "CPU"
    assert p.run.read_per_token == (0.0, 0.0)


def test_the_choice_is_run_s_own(parts: tuple[ModelShape, StorageProfile, Path]) -> None:
    _shape, _storage, path = parts
    half = _half(path)
    ch = RunChooser(path, available=LOTS, threads=1).choose(half)
    run = choose_streaming(path, AutoStream(), memory=half, available=LOTS, threads=1)
    assert ch.engine == run.engine == ("pager" if pager_works() else "page cache")
    assert run.prefetch is not None and ch.budget == run.prefetch.memory
    assert ch.plan == run.plan
    assert ch.threads == ch.threads_batch == 1 and ch.tune is None
    assert 0 < ch.cache_bytes < ch.budget and ch.slots > 0


def test_the_pager_reads_its_misses_beside_the_compute(
    parts: tuple[ModelShape, StorageProfile, Path],
) -> None:
    shape, storage, path = parts
    with MoeModel(path) as m:
        cost = _cost(parts, m)
    ch = RunChooser(path, available=LOTS, threads=1).choose(_half(path))
    if ch.engine != "pager":
        pytest.skip("userfaultfd is refused here")
    e = cost.run(ch)
    assert e.runner == "pager" and e.threads == (1, 1)
    assert e.hit is not None and e.hit.low == pytest.approx(ch.slots / shape.n_expert)
    need = shape.active_expert_bytes * (1 + LOOKAHEAD_WASTE)
    assert e.read_per_token[1] == pytest.approx(need * (1 - e.hit.low))
    bw = storage.pager_bandwidth(shape.bytes_per_expert // 3, QUEUE_DEPTH)
    c = _calibration().decode_seconds(shape, 1, MAPPED)
    io = need * (1 - e.hit.low) / bw
    assert e.decode_tps[0] == pytest.approx(1 / overlapped(io, c, DEFAULT.pager_spare))
    assert e.decode_tps[0] <= e.decode_tps[1] <= e.bound_tps
    # the run's first prompt reads every expert it touches from cold, at the batch threads
    t = shape.n_expert * (1 - (1 - shape.top_k / shape.n_expert) ** cost.prompt_tokens)
    cold = shape.moe_layers * t * shape.bytes_per_expert / bw
    pc = cost.prompt_tokens * _calibration().prefill_seconds(shape, 1, MAPPED)
    share = DEFAULT.share("pager", False)
    assert e.prefill_tps[0] == pytest.approx(cost.prompt_tokens / overlapped(cold, pc, share))
    p = cost.point(ch)
    assert not p.fits and p.verdict in ("streams", "too slow")


def test_the_tuner_chooses_as_run_s_tuner_does() -> None:
    times = {1: 1.0, 2: 0.9}
    chosen, mean = tuned((1, 2), times.__getitem__, 40)
    assert chosen == 2  # 10 % faster: more than the tuner's margin
    assert 1 / 1.0 < mean < 1 / 0.9  # the probes at 1 thread are in the run's mean
    assert tuned((1, 2), {1: 1.0, 2: 0.97}.__getitem__, 40)[0] == 1  # within the margin
    # the same count the tuner itself reaches on the same pass times
    tuner = ThreadTuner([1, 2], lambda _n: None)
    for _ in range(40):
        tuner.record(times[tuner.next_threads()])
    assert tuner.chosen == chosen


def test_a_tuned_run_is_estimated_at_the_tuner_s_choice(
    parts: tuple[ModelShape, StorageProfile, Path],
) -> None:
    _shape, _storage, path = parts
    with MoeModel(path) as m:
        cost = _cost(parts, m)
    n = cores()
    ch = RunChooser(path, available=1 << 20).at(_half(path))  # a machine it does not fit in
    assert ch.tune == (None if n < 2 else (n - 1, n)) and ch.threads == max(1, n - 1)
    if ch.tune is None or ch.engine != "pager":
        pytest.skip("one core, or no userfaultfd: nothing to tune here")
    e = cost.run(ch)
    for idx, io in ((0, e.io_s[1]), (1, e.io_s[0])):

        def pass_s(t: int, io: float = io) -> float:
            share = DEFAULT.share("pager", t >= n)
            return overlapped(io, _calibration().decode_seconds(cost.shape, t, MAPPED), share)

        chosen, mean = tuned(ch.tune, pass_s, cost.decode_tokens)
        assert e.threads[idx] == chosen
        assert e.decode_tps[idx] == pytest.approx(1 / pass_s(chosen))
        assert e.run_decode_tps[idx] == pytest.approx(mean)
    assert cost.run(ch, "serve").threads == (ch.threads, ch.threads)  # serve has no tuner
    # the one line names the count the tuner settles on, and the counts it chose between
    lo, hi = ch.tune
    chosen = e.threads[0]
    line = ch.describe(chosen)
    assert f"decode at {chosen} thread" in line and f"the tuner's choice of {lo} or {hi}" in line
    assert f"decode at {lo} or {hi} threads (tuned)" in ch.describe()


def test_more_memory_never_slower(parts: tuple[ModelShape, StorageProfile, Path]) -> None:
    shape, storage, path = parts
    chooser = RunChooser(path, available=LOTS, threads=1)
    base = chooser.counted()
    lo = base.dense + base.reserve + chooser.choose(_half(path)).least
    hi = shape.file_bytes + base.reserve
    with MoeModel(path) as m:
        trace = synth_trace(m, tokens=400, prefill_tokens=100, seed=4)
        for hits in (HitModel(shape, None, m), HitModel(shape, trace, m)):
            cost = CostModel(shape, _calibration(), storage, hits, DEFAULT, cores())
            sizes = [lo + (hi - lo) * i // 10 for i in range(11)]
            run = [cost.run(chooser.at(x)).decode_tps for x in sizes]
            for a, b in zip(run, run[1:], strict=False):
                assert b[0] >= a[0] * 0.999 and b[1] >= a[1] * 0.999
            best = cost.best_tps(chooser.at(hi))
            k = knee(cost, chooser.at, lo, hi, best)
            for end, idx in (("low", 0), ("high", 1)):
                assert lo <= k[end] <= hi
                if k[end] < hi:
                    assert cost.run(chooser.at(k[end])).decode_tps[idx] >= KNEE_SHARE * best
            if hits.source == "trace":
                assert k["low"] == k["high"]
            others = other_sizes((lo + hi) // 2, lo, hi)
            assert len(others) == 2 and all(lo <= x <= hi for x in others)


def test_a_memory_run_refuses_is_a_refusal_in_run_s_words(
    parts: tuple[ModelShape, StorageProfile, Path],
) -> None:
    _shape, _storage, path = parts
    chooser = RunChooser(path, available=LOTS, threads=1)
    base = chooser.counted()
    memory = base.dense + base.runtime + 1  # no room for the context, nor the experts
    ch = chooser.choose(memory)
    with pytest.raises(BadInput) as e:
        choose_streaming(path, AutoStream(), memory=memory, available=LOTS, threads=1)
    assert ch.engine == "refused" and ch.refusal == e.value.message
    with MoeModel(path) as m:
        p = _cost(parts, m).point(ch)
    assert p.verdict == "refused" and p.run.runner == "refused"
    assert p.stock.runner == "mmap"  # llama.cpp's own mmap is still shown beside it


def test_other_sizes_are_chosen_by_run_s_own_code(
    parts: tuple[ModelShape, StorageProfile, Path],
) -> None:
    """``at`` (the sweeps) asks run's ``stream_in_plan`` of the counted plan at each size:
    the same engine, budget, live cache and refusal as run's whole path at that size, and
    serve's own choice where ``serve``."""
    _shape, _storage, path = parts
    chooser = RunChooser(path, available=1 << 20)  # a machine it does not fit in
    base = chooser.counted()
    least = base.dense + base.reserve + chooser.choose(_half(path)).least
    for memory in (least, _half(path), least - 1):
        swept, whole = chooser.at(memory), chooser.choose(memory)
        assert swept.engine == whole.engine and swept.refusal == whole.refusal, memory
        assert (swept.budget, swept.cache_bytes, swept.slots) == (
            whole.budget,
            whole.cache_bytes,
            whole.slots,
        )
        assert (swept.threads, swept.tune, swept.threads_batch) == (
            whole.threads,
            whole.tune,
            whole.threads_batch,
        )
    assert chooser.at(least - 1).engine == "refused"
    server = RunChooser(path, available=1 << 20, serve=True)
    memory = _half(path) * 8 // 7  # about half the experts left once the prefix cache is in
    # serve's --prefix-cache by default (2 GiB or an eighth of its memory), counted in it
    prefix = budget_bytes(ServeOptions(memory=memory))
    assert 0 < prefix < memory // 7
    for served in (server.choose(memory), server.at(memory)):
        assert served.plan.prefix_cache == prefix and served.tune is None  # serve: no tuner
        assert served.budget == chooser.choose(memory - prefix).budget > 0


def test_serve_s_context_is_a_whole_number_of_llama_cpp_s_steps(
    parts: tuple[ModelShape, StorageProfile, Path],
) -> None:
    _shape, _storage, path = parts
    assert RunChooser(path, available=LOTS, n_ctx=1000, serve=True).n_ctx == 1024
    assert RunChooser(path, available=LOTS, n_ctx=1000).n_ctx == 1000


def test_overlap_between_the_bound_and_the_sum() -> None:
    assert overlapped(2.0, 1.0, 1.0) == 2.0 and overlapped(2.0, 1.0, 0.0) == 3.0
    assert overlapped(1.0, 2.0, 0.25) == 2.75
    cells = [(io, 1.0, overlapped(io, 1.0, 0.37)) for io in (0.2, 0.6, 1.0, 1.7, 3.0)]
    assert fitted_share(cells) == pytest.approx(0.37)
    o = dataclasses.replace(DEFAULT, pager_spare=0.5, pager_all=0.2)
    assert isinstance(o, Overlap) and o.share("pager", True) == 0.2
    assert o.share("pager", False) == 0.5 and o.share("page cache", True) == o.page_cache_all


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
