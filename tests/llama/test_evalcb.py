"""The eval-callback plumbing reads llama.cpp's own graph tensors, strided views included."""

from __future__ import annotations

import numpy as np
import pytest

from moefixtures import tiny_spec
from moepack.checkpoint.synth import synth_model
from moepack.llama.prefetcher.evalcb import EvalCallback, name_pattern
from moepack.llama.runtime.session import LlamaSession, SessionParams

pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("evalcb")
    return str(synth_model(d / "m.gguf", tiny_spec(layers=3, experts=8, top_k=3)).paths[0])


def test_name_pattern_is_anchored_at_both_ends():
    p = name_pattern(["ffn_moe_topk"])
    m = p.match(b"ffn_moe_topk-12")
    assert m is not None and m.groups() == (b"ffn_moe_topk", b"12")
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


def test_deferred_reads_come_at_the_expert_matmul_with_the_same_values(model):
    """``defer``: one read per slot and layer, at the layer's MUL_MAT_ID, equal to the
    tensors asked for one by one (the router's choice and weights are still intact)."""
    names = ["ffn_moe_topk", "ffn_moe_weights", "ffn_moe_weights_norm"]
    direct: list[tuple[str, int, np.ndarray]] = []
    deferred: list[tuple[str, int, np.ndarray]] = []
    params = SessionParams(n_ctx=64, n_batch=16, n_ubatch=16)
    tokens = [1, 7, 9, 40, 41, 100, 3]
    s = LlamaSession(model, params, EvalCallback(names, lambda *e: direct.append(e)))
    s.decode(tokens, 0, all_logits=True)
    s.close()
    cb = EvalCallback(
        (),
        lambda *e: deferred.append(e),
        defer={"ffn_moe_topk": "ids", **dict.fromkeys(names[1:], "w")},
    )
    s = LlamaSession(model, params, cb)
    s.decode(tokens, 0, all_logits=True)
    s.close()
    assert [(n, il) for n, il, _ in deferred] == [
        (n, il) for il in range(3) for n in ("ffn_moe_topk", "ffn_moe_weights_norm")
    ]
    by_key = {(n, il): a for n, il, a in direct}
    for n, il, a in deferred:
        np.testing.assert_array_equal(a, by_key[(n, il)])
    assert cb.unflushed == 0


def test_the_c_gate_and_python_deliver_the_same(model):
    """The asks answered in C (when a compiler is here) or in Python: same reads, same order."""
    got = {}
    defer = {"ffn_moe_topk": "ids", "ffn_moe_weights_norm": "w"}
    for use_gate in (True, False):
        seen: list[tuple[str, int, np.ndarray]] = []

        def keep(n: str, il: int, a: np.ndarray, seen: list = seen) -> None:
            seen.append((n, il, a))

        cb = EvalCallback(["ffn_moe_probs"], keep, defer, use_gate=use_gate)
        s = LlamaSession(model, SessionParams(n_ctx=64, n_batch=16, n_ubatch=16), cb)
        s.decode([1, 7, 9, 40], 0, all_logits=True)
        s.decode([41], 4, all_logits=True)
        s.close()
        got[cb.kind] = seen
    assert "python" in got
    if len(got) == 2:
        a, b = got["c-gate"], got["python"]
        assert [(n, il) for n, il, _ in a] == [(n, il) for n, il, _ in b]
        for (_, _, x), (_, _, y) in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)


def test_record_mode_copies_in_c_what_python_reads(model):
    """``record_bytes``: the gate copies the deferred tensors itself; ``drain`` delivers
    them after the call, equal to the reads made in Python."""
    defer = {"ffn_moe_topk": "ids", "ffn_moe_weights": "w", "ffn_moe_weights_norm": "w"}
    runs = {}
    for record in (0, 1 << 20):
        seen: list[tuple[str, int, np.ndarray]] = []

        def keep(n: str, il: int, a: np.ndarray, seen: list = seen) -> None:
            seen.append((n, il, a.reshape(-1, 3)))

        cb = EvalCallback((), keep, defer, record_bytes=record)
        s = LlamaSession(model, SessionParams(n_ctx=64, n_batch=16, n_ubatch=4), cb)
        s.decode([1, 7, 9, 40, 41, 100, 3, 5, 6], 0, all_logits=True)
        cb.drain()
        s.close()
        runs[cb.recording] = seen
    if True not in runs:
        pytest.skip("no C compiler: record mode falls back to reads in Python")
    a, b = runs[True], runs[False]
    assert [(n, il) for n, il, _ in a] == [(n, il) for n, il, _ in b]
    assert len(a) == 3 * 2 * 3  # 3 micro-batches x (ids, final weights) x 3 layers
    for (_, _, x), (_, _, y) in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def test_the_session_keeps_one_thread_pool_for_every_split(model):
    """The session attaches a ggml thread pool that lives as long as it does (so a split
    graph does not set up workers again), frees it on close, and a graph split by the
    callback computes the same logits as an unsplit one."""
    plain = LlamaSession(model, SessionParams(n_ctx=64, n_batch=16, n_ubatch=16, threads=3))
    pool = plain.threadpool
    assert pool is not None and pool.pool
    want = plain.decode([1, 7, 9, 40], 0, all_logits=True)
    plain.close()
    assert plain.threadpool is None and pool.pool is None
    cb = EvalCallback(["ffn_moe_topk"], lambda n, layer, a: None)
    split = LlamaSession(model, SessionParams(n_ctx=64, n_batch=16, n_ubatch=16, threads=3), cb)
    assert split.threadpool is not None and split.threadpool.pool
    got = split.decode([1, 7, 9, 40], 0, all_logits=True)
    assert cb.calls == 3
    split.close()
    np.testing.assert_array_equal(got, want)
