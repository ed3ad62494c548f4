"""The eval-callback plumbing reads llama.cpp's own graph tensors, strided views included."""

from __future__ import annotations

import numpy as np
import pytest

from moefixtures import tiny_spec
from moepack.checkpoint.synth import synth_model
from moepack.llama.evalcb import EvalCallback, name_pattern
from moepack.llama.session import LlamaSession, SessionParams

pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("evalcb")
    return str(synth_model(d / "m.gguf", tiny_spec(layers=3, experts=8, top_k=3)).paths[0])


def test_name_pattern_is_anchored_at_both_ends():
    p = name_pattern(["ffn_moe_topk"])
    assert p.match(b"ffn_moe_topk-12").groups() == (b"ffn_moe_topk", b"12")
    for other in (b"ffn_moe_topk-1 (view)", b"xffn_moe_topk-1", b"ffn_moe_topk", b"ffn_moe_topk-"):
        assert p.match(other) is None


def test_topk_view_is_read_with_its_strides(model):
    seen: list[tuple[str, int, np.ndarray]] = []
    cb = EvalCallback(
        ["ffn_moe_topk", "ffn_moe_probs", "ffn_moe_weights_norm"],
        lambda n, layer, a: seen.append((n, layer, a)),
    )
    s = LlamaSession(model, SessionParams(n_ctx=64, n_batch=16, n_ubatch=16), cb)
    s.decode([1, 7, 9, 40, 41, 100], 0, all_logits=True)
    s.close()
    names = [(n, layer) for n, layer, _ in seen]
    order = ("ffn_moe_probs", "ffn_moe_topk", "ffn_moe_weights_norm")
    assert names == [(n, il) for il in range(3) for n in order]
    for il in range(3):
        probs, topk, w = (a for n, layer, a in seen if layer == il)
        assert topk.shape == (6, 3) and topk.dtype == np.int32
        # the view's rows are the first k of the descending sort of the router's probabilities
        np.testing.assert_array_equal(topk, np.argsort(-probs, axis=1, kind="stable")[:, :3])
        chosen = np.take_along_axis(probs, topk, axis=1)
        np.testing.assert_allclose(w, chosen / chosen.sum(1, keepdims=True), rtol=1e-5)
    assert cb.calls == 9


def test_a_handler_error_stops_the_computation_and_is_raised(model):
    def handler(name: str, layer: int, a: np.ndarray) -> None:
        if layer == 1:
            raise KeyError("stop here")

    cb = EvalCallback(["ffn_moe_topk"], handler)
    s = LlamaSession(model, SessionParams(n_ctx=64, n_batch=16, n_ubatch=16), cb)
    with pytest.raises(KeyError, match="stop here"):
        s.decode([1, 7, 9], 0, all_logits=True)
    assert cb.calls == 2  # layer 2 was never computed
    s.close()
