"""check-dropin's routing and output gates on the arrays the runs spool: near-ties are judged
against a tolerance measured from the F16-KV run, the worst order change is named, and the KL
envelope is whatever that run measured (llama.cpp's runs themselves: test_dropin, slow)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moepack.llama.judge.dropin import (
    CandidateOrder,
    DropinResult,
    DropinRun,
    Gate,
    candidate_order,
    combined_envelope,
    mean_kl,
    output_gate,
    routing_gate,
    weight_envelope,
)
from moepack.llama.judge.dropin_worker import window_sentence
from moepack.rewrite.verify import VerifyResult

T, K, E = 6, 2, 4


def _run(ids, weights, logits=None) -> DropinRun:
    ids = np.asarray(ids, dtype=np.uint8).reshape(T, 1, K)
    weights = np.asarray(weights, dtype=np.float32).reshape(T, 1, K)
    if logits is None:
        logits = np.zeros((T, 8), np.float32)
    return DropinRun(np.arange(T, dtype=np.int32), ids, weights, logits, [T])


IDS = [[0, 1]] * T
W = [[0.7, 0.3]] * 3 + [[0.5003, 0.4997]] + [[0.6, 0.4]] * 2
IDENTITY = CandidateOrder({}, "identity (none recorded)")


def test_the_tolerance_is_twice_the_largest_weight_change_of_the_f16_kv_run():
    a = _run(IDS, W)
    moved = np.asarray(W, np.float32).copy()
    moved[2] += [0.004, -0.004]
    moved[5] += [-0.001, 0.001]
    a16 = _run(IDS, moved)
    assert weight_envelope(a, a16) == pytest.approx(0.004, abs=1e-6)
    # a token routed to other experts says nothing of how far a weight moves
    other = np.asarray(IDS).copy()
    other[2] = [2, 3]
    assert weight_envelope(a, _run(other, moved)) == pytest.approx(0.001, abs=1e-6)
    # experts matched by id, not by position
    flipped = _run([[1, 0]] * T, np.asarray(W)[:, ::-1])
    assert weight_envelope(a, flipped) == 0.0


def test_a_swap_within_the_tolerance_is_a_near_tie_and_one_beyond_fails_naming_the_worst():
    a = _run(IDS, W)
    a16 = _run(IDS, np.asarray(W) + [[0.002, -0.002]])  # tolerance 0.004
    swapped = np.asarray(IDS).copy()
    swapped[3] = [1, 0]  # the 0.5003 / 0.4997 token: 6e-4 apart
    bw = np.asarray(W).copy()
    bw[3] = [0.5068, 0.4932]
    g = routing_gate(a, _run(swapped, bw), a16, [7], IDENTITY, E)
    assert g.ok, g.summary
    assert g.numbers["near_ties"] == 1 and g.numbers["same_order"] == pytest.approx(5 / 6)
    assert g.numbers["order_tolerance"] == pytest.approx(0.004, abs=1e-6)
    assert "near-tie" in g.summary
    swapped[0] = [1, 0]  # a 0.7 / 0.3 token: a real order change
    bw[0] = [0.3, 0.7]
    g = routing_gate(a, _run(swapped, bw), a16, [7], IDENTITY, E)
    assert not g.ok
    assert g.numbers["same_set"] == 1.0 and g.numbers["near_ties"] == 1
    assert g.numbers["worst_order_change"] == {
        "token": 0,
        "block": 7,
        "experts": [0, 1],
        "original_weights": [pytest.approx(0.7), pytest.approx(0.3)],
        "candidate_weights": [pytest.approx(0.7), pytest.approx(0.3)],
    }
    assert "worst order change at token 0, block 7: experts 0 and 1 swapped" in g.summary
    assert "0.7000/0.3000" in g.summary and "tolerance 0.004" in g.summary
    # with no F16-KV movement at all, nothing is a near-tie
    g = routing_gate(a, _run(swapped, bw), a, [7], IDENTITY, E)
    assert not g.ok and g.numbers["near_ties"] == 0 and g.numbers["order_tolerance"] == 0.0


def test_a_set_change_beyond_the_last_expert_fails_whatever_the_weights():
    a = _run(IDS, W)
    other = np.asarray(IDS).copy()
    other[4] = [2, 1]  # the first expert traded: no near-tie at the top-k boundary
    g = routing_gate(a, _run(other, W), _run(IDS, np.full((T, K), 0.5)), [7], IDENTITY, E)
    assert not g.ok and g.numbers["same_set"] == pytest.approx(5 / 6)
    assert g.numbers["set_near_ties"] == 0
    assert "first set change at token 4, block 7" in g.summary


def test_the_last_expert_traded_at_a_near_tie_is_a_selection_near_tie():
    """Rounding may decide between the k-th and (k+1)-th expert as it decides an order: the
    last expert traded for one whose weight lies within the tolerance is forgiven, one beyond
    it is not, and top-1 routing (its one weight always 1) never is."""
    a = _run(IDS, W)
    a16 = _run(IDS, np.asarray(W) + [[0.002, -0.002]])  # tolerance 0.004
    other = np.asarray(IDS).copy()
    other[3] = [0, 2]
    near = np.asarray(W, np.float32).copy()
    near[3] = [0.5, 0.4999]  # expert 2's weight next to the one expert 1 had (0.4997)
    g = routing_gate(a, _run(other, near), a16, [7], IDENTITY, E)
    assert (
        g.ok and g.numbers["set_near_ties"] == 1 and g.numbers["same_set"] == pytest.approx(5 / 6)
    )
    assert g.numbers["same_set_but_near_ties"] == 1.0 and "selection near-tie" in g.summary
    far = near.copy()
    far[3] = [0.6, 0.4]
    g = routing_gate(a, _run(other, far), a16, [7], IDENTITY, E)
    assert not g.ok and g.numbers["set_near_ties"] == 0
    one = CandidateOrder({}, "identity (none recorded)")
    ids1 = np.zeros((T, 1, 1), np.uint8)
    w1 = np.ones((T, 1, 1), np.float32)
    run1 = DropinRun(np.arange(T, dtype=np.int32), ids1, w1, np.zeros((T, 8), np.float32), [T])
    moved = ids1.copy()
    moved[2] = 3
    run2 = DropinRun(run1.tokens, moved, w1, run1.logits, [T])
    assert not routing_gate(run1, run2, run1, [7], one, E).ok


def test_the_routing_is_mapped_back_through_the_candidates_order():
    a = _run(IDS, W)
    slots = [[2, 3]] * T  # the candidate keeps experts 0, 1 in slots 2, 3
    order = CandidateOrder({7: np.array([3, 2, 0, 1])}, "found by verify")
    assert routing_gate(a, _run(slots, W), a, [7], order, E).ok
    assert not routing_gate(a, _run(slots, W), a, [7], IDENTITY, E).ok


def test_the_order_comes_from_what_verify_found(tmp_path):
    def result(source: str, perms: dict[int, list[int]] | None) -> VerifyResult:
        v = VerifyResult(True, [], [], source)
        v.permutations = perms
        return v

    found = candidate_order(result("discovered", {3: [1, 0, 2, 3]}), tmp_path / "x.gguf")
    assert found.source == "found by verify (the file records none)"
    assert found.perm(3, 4).tolist() == [1, 0, 2, 3] and found.perm(4, 4).tolist() == [0, 1, 2, 3]
    assert candidate_order(result("provenance", {}), tmp_path / "x.gguf").source == "recorded"
    none = candidate_order(result("discovered", {}), tmp_path / "x.gguf")
    assert none.source == "identity (verify found none)" and not none.perms


def test_the_kl_envelope_is_what_the_f16_kv_run_measured():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((T, 8)).astype(np.float32)
    a = _run(IDS, W, logits)
    b = _run(IDS, W, logits + np.float32(1e-3) * rng.standard_normal((T, 8)).astype(np.float32))
    envelopes = []
    for scale in (1e-4, 1e-2):
        noise = np.float32(scale) * rng.standard_normal((T, 8)).astype(np.float32)
        a16 = _run(IDS, W, logits + noise)
        g = output_gate(a, b, a16)
        assert g.numbers["envelope_kl"] == mean_kl(logits, a16.logits)
        assert g.numbers["margin"] == pytest.approx(g.numbers["kl"] / g.numbers["envelope_kl"])
        assert g.ok == (g.numbers["kl"] <= g.numbers["envelope_kl"])
        envelopes.append(g.numbers["envelope_kl"])
    assert envelopes[0] < envelopes[1]  # measured, not a constant
    assert [output_gate(a, b, _run(IDS, W, n)).ok for n in (logits, b.logits)] == [False, True]


def test_a_failure_is_one_line_with_each_failed_gates_evidence():
    r = DropinResult(
        Path("a.gguf"),
        Path("b.gguf"),
        8,
        [Gate("bytes", True, "every byte"), Gate("routing", False, "99.00 % as sets")],
    )
    assert r.failure() == "not a drop-in: the routing gate failed (99.00 % as sets)"
    assert "\n" not in r.failure()


def test_a_failed_decode_says_which_run_and_window():
    label = "the run of CANDIDATE (F32 KV cache)"
    assert window_sentence(label, 1, 4, 255, 255, 1) == (
        "the run of CANDIDATE (F32 KV cache), window 2 of 4: start token 1, then text tokens "
        "255-509"
    )
    assert window_sentence(label, 0, 1, 0, 256, None).endswith("window 1 of 1: text tokens 0-255")


def test_the_position_control_widens_the_envelope_as_a_distance():
    """The position control (ORIGINAL with its experts reordered) measures what an expert's
    position changes in llama.cpp's arithmetic (the router softmax's sum order); the envelope
    adds its distance to the F16-KV run's, sqrt(KL) being a distance."""
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((T, 8)).astype(np.float32)
    noise = rng.standard_normal((T, 8)).astype(np.float32)

    def near(scale: float) -> DropinRun:  # KL grows as scale squared along one direction
        return _run(IDS, W, logits + np.float32(scale) * noise)

    a, a16, pos, b = _run(IDS, W, logits), near(1e-3), near(3e-3), near(3.5e-3)
    kv, position = mean_kl(logits, a16.logits), mean_kl(logits, pos.logits)
    alone, widened = output_gate(a, b, a16), output_gate(a, b, a16, pos)
    assert not alone.ok and widened.ok  # what the F16 KV alone refuses, position covers
    assert widened.numbers["kv_envelope_kl"] == kv and widened.numbers["position_kl"] == position
    assert widened.numbers["envelope_kl"] == pytest.approx((np.sqrt(kv) + np.sqrt(position)) ** 2)
    assert combined_envelope(kv, 0.0) == kv and combined_envelope(0.0, position) == position
    assert "expert position" in widened.summary
    # a change far beyond both still fails
    assert not output_gate(a, near(1e-1), a16, pos).ok


def test_the_order_tolerance_adds_the_position_controls_weight_move():
    a = _run(IDS, W)
    a16 = _run(IDS, np.asarray(W) + [[0.002, -0.002]])
    pos = _run(IDS, np.asarray(W) + [[-0.001, 0.001]])
    swapped = _run([[1, 0]] * T, np.asarray(W)[:, ::-1])  # every row in the other order
    tight = routing_gate(a, swapped, a16, [0], IDENTITY, E)
    wide = routing_gate(a, swapped, a16, [0], IDENTITY, E, position=pos)
    assert tight.numbers["order_tolerance"] == pytest.approx(0.004, abs=1e-6)
    assert wide.numbers["order_tolerance"] == pytest.approx(0.006, abs=1e-6)
    assert wide.numbers["near_ties"] == tight.numbers["near_ties"] == 1  # 0.5003/0.4997 only
    assert wide.numbers["order_tolerance_from"] == "F16-KV run and position control"


def test_without_a_position_control_the_gate_says_why():
    a = _run(IDS, W, np.zeros((T, 8), np.float32))
    g = output_gate(a, a, a, None, "a reordered copy needs 9 bytes, 3 are free in /tmp")
    assert g.ok and g.numbers["position_kl"] == 0.0
    assert g.numbers["position_control"].startswith("a reordered copy needs")
    assert "no position control: a reordered copy needs 9 bytes" in g.summary
    assert output_gate(a, a, a).numbers["position_control"] == "none"
