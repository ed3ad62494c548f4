"""The adaptive draft length and the drafting options, without llama.cpp: the length follows
measured acceptance and measured pass costs, down to none, and probes while off."""

from __future__ import annotations

import pytest

from moepack.errors import BadInput
from moepack.llama.runtime.draft import DEFAULT_LENGTH, MTP_UNREACHABLE, DraftOptions, parse_draft
from moepack.llama.runtime.drafting import PROBE_EVERY, AdaptiveLength


def _feed(lengths: AdaptiveLength, accept: float, one: float, per_token: float, passes: int):
    """``passes`` passes of a workload whose drafts are accepted with chance ``accept`` each
    (deterministically: the first round(accept * k) of k) and whose passes cost ``one``
    seconds plus ``per_token`` per extra token."""
    chosen = []
    for _ in range(passes):
        k = lengths.length(64)
        chosen.append(k)
        lengths.observe_pass(1 + k, one + per_token * k)
        if k:
            lengths.observe_draft(k, min(k, round(accept * k)), 1e-5 * k)
    return chosen


def test_good_cheap_drafts_stay_long_and_bad_ones_turn_drafting_off():
    good = _feed(AdaptiveLength(8), accept=1.0, one=0.1, per_token=0.01, passes=40)
    assert min(good[5:]) >= 6
    bad = AdaptiveLength(8)
    chosen = _feed(bad, accept=0.0, one=0.1, per_token=0.02, passes=60)
    assert chosen[10:].count(0) >= 40  # off, but for the probes
    assert set(chosen[10:]) <= {0, 2}


def test_costly_passes_turn_even_accepted_drafts_off():
    # a pass of k+1 tokens costing k+1 one-token passes gains nothing at any acceptance
    chosen = _feed(AdaptiveLength(8), accept=0.5, one=0.1, per_token=0.1, passes=60)
    assert chosen[10:].count(0) >= 40


def test_off_probes_every_so_often_and_comes_back_when_drafts_are_accepted_again():
    lengths = AdaptiveLength(8)
    _feed(lengths, accept=0.0, one=0.1, per_token=0.02, passes=40)
    assert lengths.length(64) == 0
    later = _feed(lengths, accept=1.0, one=0.1, per_token=0.02, passes=4 * PROBE_EVERY)
    assert max(later[-5:]) >= 4


def test_a_fixed_length_is_kept_and_never_exceeds_what_remains():
    lengths = AdaptiveLength(5, adaptive=False)
    assert _feed(lengths, accept=0.0, one=0.1, per_token=1.0, passes=5) == [5] * 5
    assert lengths.length(3) == 3 and lengths.length(0) == 0


def test_parse_draft():
    assert parse_draft("off") == DraftOptions()
    assert parse_draft("prompt-lookup") == DraftOptions("prompt-lookup", DEFAULT_LENGTH)
    assert parse_draft("prompt-lookup:4") == DraftOptions("prompt-lookup", 4)
    assert parse_draft("off", "d.gguf") == DraftOptions("model", DEFAULT_LENGTH, "d.gguf")
    assert parse_draft("model:3", "d.gguf") == DraftOptions("model", 3, "d.gguf")
    for spec, why in [
        ("mtp", "cannot run MTP drafts"),
        ("prompt-lookup:x", "a draft length is a number"),
        ("prompt-lookup:65", "a draft is 1 to 64 tokens"),
        ("lookup", "`draft` is one of"),
        ("model", "a draft model is given exactly when"),
    ]:
        with pytest.raises(BadInput, match=why):
            parse_draft(spec)
    with pytest.raises(BadInput, match="two drafters"):
        parse_draft("prompt-lookup", "d.gguf")
    assert "\n" not in MTP_UNREACHABLE


def test_the_default_threads_leave_a_core_to_the_reads_when_the_model_does_not_fit(
    tmp_path, monkeypatch
):
    import os

    from moefixtures import tiny_spec
    from moepack.checkpoint.synth import synth_model
    from moepack.llama.runtime import run

    path = synth_model(tmp_path / "m.gguf", tiny_spec()).paths[0]
    cores = len(os.sched_getaffinity(0))
    assert run.default_threads(path) == cores  # it fits: every core computes
    monkeypatch.setattr(run, "mem_available", lambda: 4096)  # a machine with a page free
    assert run.default_threads(path) == max(1, cores - 1)


def test_rejected_probes_come_ever_more_seldom_and_the_cold_first_pass_is_replaced():
    lengths = AdaptiveLength(8)
    assert lengths.length(64) == 0
    lengths.observe_pass(1, 5.0)  # the first decode pass, its experts read cold
    lengths.observe_pass(1, 0.1)
    assert lengths.cost[1] == 0.1  # the second replaces it, no average with the cold one
    chosen = _feed(lengths, accept=0.0, one=0.1, per_token=0.05, passes=400)
    probes = [i for i, k in enumerate(chosen) if k and i > 4]
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert len(probes) <= 6 and gaps == sorted(gaps) and gaps[-1] > 4 * PROBE_EVERY
