"""check-dropin on a model where an expert's position moves llama.cpp's output more than the
F16 KV cache does: qwen35moe, whose KV cache is in one layer of four, and whose router softmax
sums its 32 exponentials in expert order (see moepack.llama.judge.position). An honest repack
passes on two texts, where the F16-KV envelope alone refuses it on one; the widened envelope
still refuses a file whose experts moved without their router rows."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from moepack.checkpoint import MoeModel
from moepack.checkpoint.synth import SynthSpec, synth_model
from moepack.layout.plan import LayerPlan, Plan
from moepack.llama.judge.dropin import DropinResult, Gate, check_dropin
from moepack.llama.judge.position import write_position_control
from moepack.llama.prefetcher.evalcb import EvalCallback
from moepack.llama.runtime.session import LlamaSession, SessionParams
from moepack.rewrite.repack import repack

pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
pytestmark = pytest.mark.slow

# 32 experts: the router softmax's sum runs in float lanes (below 16 experts on AVX-512, 8 on
# AVX2, it is all in double and a reorder changes nothing). F16 weights: no routing flips.
SPEC = SynthSpec(
    arch="qwen35moe",
    layers=4,
    experts=32,
    top_k=4,
    hidden=256,
    expert_ffn=128,
    weight_type="F16",
    vocab=512,
)
PERM_SEED = 6  # a repack whose reassociation lands above the F16 KV cache's change here
FOX = (
    "The quick brown fox jumps over the lazy dog while the farmer watches from the old red "
    "barn on the hill."
)
TEXTS = {"stdlib docs": (None, 256, 64), "one sentence": (FOX, 64, 32)}


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("position")
    original = synth_model(d / "m.gguf", SPEC).paths[0]
    rng = np.random.default_rng(PERM_SEED)
    with MoeModel(original) as m:
        plan = Plan(
            [LayerPlan(b.index, rng.permutation(b.n_expert)) for b in m.blocks], m.fingerprint
        )
    return original, repack(original, plan, d / "r.gguf").outputs[0]


def _gates(r: DropinResult) -> dict[str, Gate]:
    return {g.name: g for g in r.gates}


def test_an_honest_repack_passes_on_two_texts_where_the_kv_envelope_alone_fails_one(pair):
    original, candidate = pair
    margins_kv_only = {}
    for name, (text, n, window) in TEXTS.items():
        r = check_dropin(original, candidate, n_tokens=n, text=text, window=window)
        gates = _gates(r)
        out = gates["output"].numbers
        assert r.ok, (name, r.failure())
        assert gates["routing"].numbers["same_set"] == 1.0  # only the arithmetic moved
        assert out["position_kl"] > 0  # the control measured the position's change
        assert out["kl"] > 0  # and the candidate shows one
        assert out["envelope_kl"] == pytest.approx(
            (np.sqrt(out["kv_envelope_kl"]) + np.sqrt(out["position_kl"])) ** 2
        )
        margins_kv_only[name] = out["margin_kv_only"]
    # the F16 KV cache alone would have failed the repack on the standard-library text (and,
    # with AVX-512's 16-float lanes summing the router softmax, on the sentence too: 1.30 where
    # the portable AVX2 build gives a margin under 1)
    assert margins_kv_only["stdlib docs"] > 1.0, margins_kv_only


def test_experts_moved_without_their_router_rows_still_fail(pair, tmp_path):
    """The widened envelope is the size of a reorder's rounding, not of a wrong file."""
    original, _ = pair
    bad = tmp_path / "bad.gguf"
    shutil.copy(original, bad)
    swap = np.roll(np.arange(SPEC.experts), 1)
    with MoeModel(original) as m, open(bad, "r+b") as fh:
        for b in m.blocks:
            for t in b.weight_tensors:  # the expert matrices move, the router stays
                s = t.slice_bytes
                src = np.asarray(m.shards[t.shard].reader.data[t.entry.offset : t.entry.end])
                fh.seek(t.entry.offset)
                fh.write(b"".join(src[e * s : (e + 1) * s].tobytes() for e in swap))
    text, n, window = TEXTS["one sentence"]
    r = check_dropin(original, bad, n_tokens=n, text=text, window=window)
    out = _gates(r)["output"]
    assert not out.ok and out.numbers["position_kl"] > 0
    assert out.numbers["kl"] > 100 * out.numbers["envelope_kl"]


def _first_block(path: Path, tokens: list[int]) -> dict[str, np.ndarray]:
    """Block 0's router logits and probabilities and its experts' outputs, as llama.cpp
    computed them over ``tokens``."""
    got: dict[str, np.ndarray] = {}

    def keep(name: str, layer: int, a: np.ndarray) -> None:
        if layer == 0:
            got[name] = a

    cb = EvalCallback(["ffn_moe_logits", "ffn_moe_probs", "ffn_moe_down"], keep)
    n = len(tokens)
    s = LlamaSession(str(path), SessionParams(n_ctx=n, n_batch=n, n_ubatch=n), cb)
    try:
        s.decode(tokens, 0, all_logits=True)
    finally:
        s.close()
    return got


def test_the_router_softmax_is_where_an_experts_position_enters(pair, tmp_path):
    """ORIGINAL against its position control, block 0: the router's logits are the same
    numbers in another order, the experts' outputs are bit-identical, and the softmax over the
    logits (ggml_soft_max, summing in expert order) is what differs, by an ulp or two."""
    original, _ = pair
    control = write_position_control(original, tmp_path)
    assert control.path is not None and not control.skipped
    perm = control.perms[0]  # control slot -> ORIGINAL's expert
    tokens = [1] + list(range(300, 363))
    a, c = _first_block(original, tokens), _first_block(control.path, tokens)
    np.testing.assert_array_equal(a["ffn_moe_logits"][:, perm], c["ffn_moe_logits"])
    np.testing.assert_array_equal(a["ffn_moe_down"], c["ffn_moe_down"])
    probs_a, probs_c = a["ffn_moe_probs"][:, perm], c["ffn_moe_probs"]
    assert not np.array_equal(probs_a, probs_c)
    np.testing.assert_allclose(probs_a, probs_c, rtol=0, atol=1e-6)
