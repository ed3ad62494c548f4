"""``serve.embedding``: embeddings by a generating ``Llama`` in a llama.cpp context of their
own, on each family the serve tests use (qwen3moe, the delta-net hybrid qwen35moe): a vector
a text, the same for the same text whatever came with it and llama-cpp-python's own mean
pooling of it, a text longer than a pass included, the generating context's KV cache
untouched, a stop aborting the pass (the stop's 503)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from moefixtures import tiny_spec
from moepack.checkpoint.synth import synth_model
from moepack.serve.embedding import Embedder, normalized
from moepack.serve.shapes import Refused

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
pytestmark = pytest.mark.slow

SHAPE = dict(layers=4, experts=16, top_k=2, hidden=128, expert_ffn=64, heads=4, kv_heads=2,
             head_dim=32, weight_type="Q8_0")  # fmt: skip
TEXTS = ["the quick brown fox", "a lazy dog", "word " * 40]


@pytest.fixture(scope="module", params=["qwen3moe", "qwen35moe"])
def path(request, tmp_path_factory) -> str:
    return str(synth_model(tmp_path_factory.mktemp(request.param) / "m.gguf",
                           tiny_spec(arch=request.param, **SHAPE)).paths[0])  # fmt: skip


@pytest.fixture(scope="module")
def llm(path) -> Iterator[Any]:
    """The served model as serve makes it, passes of 32 tokens (``--batch 32``)."""
    model = llama_cpp.Llama(path, n_ctx=512, n_batch=32, n_ubatch=32, n_threads=1, verbose=False)
    yield model
    model.close()


def _greedy(llm: Any) -> str:
    out = llm.create_completion("the quick brown", max_tokens=6, temperature=0)
    return str(out["choices"][0]["text"])


def test_a_vector_a_text_the_same_for_the_same_text(llm):
    embedder = Embedder(llm, 512)
    _greedy(llm)  # the prompt in the KV cache: from now on its prefix is kept (its own numbers)
    before = _greedy(llm)
    tokens = [embedder.tokens(t) for t in TEXTS]
    together = embedder.embed(tokens)
    assert together.vectors.shape == (3, SHAPE["hidden"]) and np.isfinite(together.vectors).all()
    assert together.tokens == sum(len(t) for t in tokens)
    alone = [embedder.embed([t]).vectors[0] for t in reversed(tokens)][::-1]
    assert np.allclose(np.array(alone), together.vectors, atol=1e-5)  # no state between texts
    unit = normalized(together.vectors)
    assert np.allclose(np.linalg.norm(unit, axis=1), 1.0)
    assert not np.allclose(unit[0], unit[1])
    # the generating context is as it was: its cached prompt gives the same greedy text (one
    # computed again from the start differs here on qwen3moe: a prompt in one batch)
    assert _greedy(llm) == before
    assert embedder.embed([]).vectors.shape == (0, SHAPE["hidden"])
    with pytest.raises(ValueError):
        embedder.embed([list(range(1, 600))])
    with pytest.raises(ValueError):
        embedder.embed([[]])


def test_the_vectors_are_llama_cpps_own_mean_pooling(llm, path):
    """The same text through llama-cpp-python's own embedding (a ``Llama`` made for it, the
    whole text in one pass, pooled by llama.cpp) and through the served model in passes of 32
    tokens, pooled here: the same vector."""
    embedder = Embedder(llm, 512)
    ours = embedder.embed([embedder.tokens(t) for t in TEXTS]).vectors
    assert len(embedder.tokens(TEXTS[2])) > 32  # more than one pass
    own = llama_cpp.Llama(path, n_ctx=512, n_batch=512, n_ubatch=512, n_threads=1,
                          embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
                          verbose=False)  # fmt: skip
    try:
        theirs = np.array([own.embed(t) for t in TEXTS], np.float32)
    finally:
        own.close()
    cosine = (normalized(ours) * normalized(theirs)).sum(axis=1)
    assert (cosine > 0.9999).all(), cosine  # passes of other sizes round alike, not the same
    assert np.allclose(np.linalg.norm(ours, axis=1), np.linalg.norm(theirs, axis=1), rtol=1e-3)


def test_a_stop_aborts_the_pass(llm):
    embedder = Embedder(llm, 512, aborted=lambda: True)  # the server is stopping
    with pytest.raises(Refused) as e:
        embedder.embed([embedder.tokens(TEXTS[0])])
    assert e.value.problem.status == 503 and e.value.problem.code == "server_stopping"
    assert Embedder(llm, 512).embed([embedder.tokens(TEXTS[0])]).vectors.any()  # nothing left
