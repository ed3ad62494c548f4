"""``prefetching(llm)``: the prefetcher on a ``llama_cpp.Llama`` of the caller's own changes no
number, keeps the ``Llama``'s API, survives ``reset()``, detaches, and comes back after the
context is made again."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from moefixtures import tiny_spec
from moepack.checkpoint.synth import synth_model
from moepack.errors import BadInput
from moepack.llama import StreamOptions, capturing, prefetching
from moepack.llama.prefetcher.mapping import evict

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
pytestmark = pytest.mark.slow

PROMPT = "the quick brown fox jumps over"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    spec = tiny_spec(layers=4, experts=32, top_k=4, hidden=256, expert_ffn=256, weight_type="Q8_0")
    return synth_model(tmp_path_factory.mktemp("hook") / "m.gguf", spec).paths[0]


def _llama(model: Path, **kw):
    return llama_cpp.Llama(
        str(model), n_ctx=256, n_threads=1, verbose=False, logits_all=True, seed=0, **kw
    )


def _complete(llm, n: int = 10) -> tuple[str, np.ndarray]:
    out = llm.create_completion(PROMPT, max_tokens=n, temperature=0)
    return out["choices"][0]["text"], np.array(llm.scores[: llm.n_tokens])


def test_the_hook_changes_no_logit_and_really_prefetches(model):
    plain = _llama(model)
    text, scores = _complete(plain)
    llm = _llama(model)
    hook = prefetching(llm)
    evict([model])  # cold: the prefetcher has to read the chosen experts
    got, got_scores = _complete(llm)
    assert got == text and np.array_equal(got_scores, scores)
    st = hook.snapshot()
    assert st["calls"] > 0 and st["bytes_read"] > 0 and st["demand_experts"] > 0
    assert prefetching(llm) is hook  # attaching again returns the current hook
    # the chat API streams through the hooked context as before
    msgs = [{"role": "user", "content": "hello"}]
    whole = llm.create_chat_completion(msgs, max_tokens=6, temperature=0)
    parts = llm.create_chat_completion(msgs, max_tokens=6, temperature=0, stream=True)
    pieces = "".join(c["choices"][0]["delta"].get("content", "") for c in parts)
    assert pieces == whole["choices"][0]["message"]["content"]
    hook.detach()
    plain.close()
    llm.close()


def test_reset_detach_and_a_new_context(model):
    llm = _llama(model)
    hook = prefetching(llm)
    first = _complete(llm, 6)
    llm.reset()
    evict([model])
    hook.cold_start()
    calls = hook.snapshot()["calls"]
    assert _complete(llm, 6)[0] == first[0]
    assert hook.snapshot()["calls"] > calls  # still in place after reset()
    hook.detach()
    assert hook.attached is False
    after = hook.snapshot()["calls"]
    assert _complete(llm, 6)[0] == first[0]  # the context stays, the callback is off
    assert hook.snapshot()["calls"] == after
    # the context made again (a pickled Llama restored): the hook is gone, a new one attaches
    again = pickle.loads(pickle.dumps(llm))
    fresh = prefetching(again)
    assert fresh is not hook and fresh.current
    evict([model])  # cold: a new hook asks at its first pass
    assert _complete(again, 6)[0] == first[0] and fresh.snapshot()["calls"] > 0
    fresh.detach()
    again.close()
    llm.close()


def test_routing_is_handed_on_and_bad_llamas_are_refused(model):
    seen: dict[int, list[np.ndarray]] = {}
    llm = _llama(model)
    hook = prefetching(
        llm,
        StreamOptions(lookahead="none"),
        on_route=lambda b, ids: seen.setdefault(b, []).append(ids),
    )
    _complete(llm, 4)
    hook.detach()
    assert sorted(seen) == [0, 1, 2, 3]
    for parts in seen.values():
        rows = np.concatenate(parts)
        assert rows.shape[1] == 4 and rows.min() >= 0 and rows.max() < 32
    llm.close()
    no_map = _llama(model, use_mmap=False)
    with pytest.raises(BadInput, match="not memory-mapped"):
        prefetching(no_map)
    no_map.close()


def test_capturing_hands_on_the_same_routing_without_the_prefetcher(model):
    def collect(into: dict[int, list[np.ndarray]]):
        return lambda b, ids: into.setdefault(b, []).append(np.array(ids))

    with_prefetch: dict[int, list[np.ndarray]] = {}
    llm = _llama(model)
    hook = prefetching(llm, on_route=collect(with_prefetch))
    text = _complete(llm, 4)[0]
    with pytest.raises(BadInput, match="has the prefetcher"):
        capturing(llm, collect({}))
    hook.detach()
    llm.close()
    alone: dict[int, list[np.ndarray]] = {}
    plain = _llama(model)
    route = capturing(plain, collect(alone))
    assert _complete(plain, 4)[0] == text  # the same Llama API, the same text
    assert sorted(alone) == sorted(with_prefetch) == [0, 1, 2, 3]
    for b in alone:
        assert np.array_equal(np.concatenate(alone[b]), np.concatenate(with_prefetch[b]))
    route.detach()
    seen = sum(len(v) for v in alone.values())
    _complete(plain, 2)
    assert sum(len(v) for v in alone.values()) == seen  # detached: nothing more is handed on
    plain.close()


def test_the_lazy_public_names_are_listed_and_importable() -> None:
    """``dir()`` and completion see the names ``__getattr__`` imports on first use."""
    import moepack.llama as package

    listed = dir(package)
    for name in package.__all__:
        assert name in listed
        assert getattr(package, name) is not None
    assert {"protocol", "prefetcher", "runtime", "judge"} <= {
        p.name for p in Path(package.__file__).parent.iterdir() if (p / "__init__.py").exists()
    }
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        _ = package.nothing_here
