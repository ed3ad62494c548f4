"""The decode thread count chosen from the run's own pass times: the faster count wins its
probe, the other is tried again after a doubling gap, and llama.cpp's logits are the same bits
at any thread count (so a run that switches decodes what a fixed count would)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from moefixtures import tiny_spec
from moepack.checkpoint.synth import synth_model
from moepack.llama.runtime import run as run_module
from moepack.llama.runtime.run import RunOptions, run_model, thread_choices
from moepack.llama.runtime.threadtune import FIRST_GAP, MARGIN, PROBE, ThreadTuner

PROMPT = "the quick brown fox jumps over the lazy dog"


def _drive(tuner: ThreadTuner, seconds: dict[int, float], passes: int) -> list[int]:
    used = []
    for _ in range(passes):
        n = tuner.next_threads()
        used.append(n)
        tuner.record(seconds[n])
    return used


def test_the_faster_count_wins_and_the_other_is_probed_again_after_a_doubling_gap():
    applied: list[int] = []
    tuner = ThreadTuner([2, 1], applied.append)
    assert tuner.choices == [1, 2] and tuner.current == 1  # the fewest first
    # the cold pass (untimed), then the counts take turns
    used = _drive(tuner, {1: 0.30, 2: 0.20}, 1 + 2 * PROBE)
    assert used == [1] + [1, 2] * PROBE and tuner.chosen == 2
    assert applied == [2, 1] * (PROBE - 1) + [2]
    assert set(_drive(tuner, {1: 0.30, 2: 0.20}, FIRST_GAP)) == {2}
    # the next probe: the other count first, the chosen one last (it runs on)
    used = _drive(tuner, {1: 0.30, 2: 0.20}, 2 * PROBE)
    assert used == [1, 2] * PROBE and tuner.chosen == 2
    # the choice stood: the gap doubled
    assert set(_drive(tuner, {1: 0.3, 2: 0.2}, 2 * FIRST_GAP)) == {2}
    report = tuner.report()
    assert report["chosen"] == 2 and report["probes"] == 3
    assert report["seconds_per_pass"] == {"1": 0.30, "2": 0.20}
    assert sum(report["passes"].values()) == 1 + 4 * PROBE + 3 * FIRST_GAP


def test_more_threads_must_win_by_the_margin_and_a_change_is_followed():
    tuner = ThreadTuner([1, 2], lambda n: None)
    # 2 threads a little faster, within the margin: the fewest stay
    _drive(tuner, {1: 0.30, 2: 0.30 * (1 - MARGIN / 2)}, 1 + 2 * PROBE)
    assert tuner.chosen == 1
    assert set(_drive(tuner, {1: 0.2, 2: 0.3}, FIRST_GAP)) == {1}
    # the machine changes: the next probe finds 2 clearly faster and takes it
    _drive(tuner, {1: 0.5, 2: 0.3}, 2 * PROBE)
    assert tuner.chosen == 2
    with pytest.raises(ValueError):
        ThreadTuner([0, 1], lambda n: None)


def test_a_slow_start_weighs_on_both_counts_alike():
    """The passes right after a cold start are slow whatever the count: taking turns, the
    block timed first is not blamed for them (as 2 threads here are not faster)."""
    tuner = ThreadTuner([1, 2], lambda n: None)
    slow = iter([1.0] * 5 + [0.3] * 100)
    for _ in range(1 + 2 * PROBE):
        n = tuner.next_threads()
        tuner.record(next(slow) * (1.0 if n == 1 else 1.02))
    assert tuner.chosen == 1


def test_choices_only_under_pressure_on_more_than_one_core(tmp_path, monkeypatch):
    spec = tiny_spec(layers=2, experts=8, top_k=2, hidden=64, expert_ffn=64, vocab=320)
    model = synth_model(tmp_path / "m.gguf", spec).paths[0]
    cores = len(os.sched_getaffinity(0))
    assert thread_choices(model) is None  # it fits: every core, nothing to choose
    monkeypatch.setattr(run_module, "mem_available", lambda: 1)
    assert thread_choices(model) == ((cores - 1, cores) if cores > 1 else None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    spec = tiny_spec(layers=2, experts=16, top_k=4, hidden=256, expert_ffn=256, vocab=320)
    return synth_model(tmp_path_factory.mktemp("tune") / "m.gguf", spec).paths[0]


@pytest.mark.slow
def test_logits_are_the_same_bits_at_one_and_two_threads(tiny, tmp_path):
    pytest.importorskip("llama_cpp")
    got = {}
    for t in (1, 2):
        out = tmp_path / f"t{t}.npy"
        run_model(tiny, PROMPT, RunOptions(n_predict=12, threads=t, n_ctx=256), logits_out=out)
        got[t] = np.load(out)
    assert np.array_equal(got[1], got[2])


@pytest.mark.slow
def test_a_run_without_threads_under_pressure_tunes_them_and_decodes_the_same(
    tiny, tmp_path, monkeypatch
):
    pytest.importorskip("llama_cpp")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: nothing to choose")
    fixed = tmp_path / "fixed.npy"
    base = run_model(tiny, PROMPT, RunOptions(n_predict=40, threads=1, n_ctx=256), logits_out=fixed)
    assert base.thread_tuning is None
    monkeypatch.setattr(run_module, "mem_available", lambda: 1)  # as if the model did not fit
    tuned = tmp_path / "tuned.npy"
    r = run_model(tiny, PROMPT, RunOptions(n_predict=40, n_ctx=256), logits_out=tuned)
    tuning = r.thread_tuning
    assert tuning is not None and tuning["choices"] == [r.threads, r.threads + 1]
    assert sum(tuning["passes"].values()) == len(r.generated) and tuning["probes"] >= 1
    assert set(tuning["seconds_per_pass"]) == {str(r.threads), str(r.threads + 1)}
    assert r.generated == base.generated
    assert np.array_equal(np.load(tuned), np.load(fixed))
    assert r.to_json()["thread_tuning"] == tuning
