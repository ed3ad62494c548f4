"""The prefix cache: its entries (longest prefix, whole states of recurrent models, LRU within
the byte budget, a conversation's next state replacing its last) without a model; then on
real ``Llama`` instances of tiny synthetic models (a transformer and a delta-net hybrid), an
agent's turns — turn 1 with a long system prompt, a side request with another, turn 2 — give
turn 2 turn 1's prompt back without computing it, and the greedy text every time equal to the
same turns without the cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint.synth import synth_model
from moepack.errors import BadInput
from moepack.serve.prefixcache import (
    Entry,
    PrefixStore,
    budget_bytes,
    prefix_cache,
    usable,
)
from moepack.serve.server import ServeOptions


def _entry(tokens: list[int], size: int, whole: bool = False) -> Entry:
    return Entry(np.asarray(tokens, dtype=np.intc), np.zeros(size, dtype=np.uint8), whole)


def _ids(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_the_longest_prefix_is_found_and_one_token_is_left_to_evaluate():
    store = PrefixStore(1 << 20)
    short, long = _entry(_ids(100), 10), _entry(_ids(300), 10)
    other = _entry(_ids(200, start=1000), 10)
    for e in (short, long, other):
        store.make_room(e.nbytes)
        store.add(e)
    assert len(store.entries) == 2  # ``short`` is all of ``long``'s start: replaced by it
    prompt = np.asarray(_ids(250) + [7, 7, 7], dtype=np.intc)
    assert store.best(prompt) == (long, 250)
    # a prompt the entry holds whole: its last token is evaluated again for its logits
    assert store.best(np.asarray(_ids(300), dtype=np.intc)) == (long, 299)
    assert store.best(np.asarray([5, 6, 7], dtype=np.intc)) == (None, 0)


def test_a_recurrent_state_is_used_whole_or_not_at_all():
    tokens = np.asarray(_ids(100), dtype=np.intc)
    longer = np.asarray(_ids(150), dtype=np.intc)
    shorter = np.asarray(_ids(99), dtype=np.intc)
    assert usable(tokens, longer, whole=True) == 100
    assert usable(tokens, shorter, whole=True) == 0  # it cannot be cut back
    assert usable(tokens, tokens, whole=True) == 0  # no token would be left to evaluate
    assert usable(tokens, np.asarray(_ids(50) + _ids(100, 500), dtype=np.intc), whole=True) == 0
    assert usable(tokens, shorter, whole=False) == 98
    # a whole state does not replace another it extends: each is a prefix of its own
    store = PrefixStore(1 << 20)
    a, b = _entry(_ids(100), 10, whole=True), _entry(_ids(150), 10, whole=True)
    for e in (a, b):
        store.make_room(e.nbytes)
        store.add(e)
    assert list(store.entries.values()) == [a, b]
    assert store.best(np.asarray(_ids(120), dtype=np.intc)) == (a, 100)


def test_entries_stay_within_the_budget_least_recently_used_first_out():
    size = 1000
    per = _entry(_ids(40), size).nbytes
    store = PrefixStore(3 * per)
    entries = [_entry(_ids(40, start=1000 * i), size) for i in range(3)]
    for e in entries:
        assert store.make_room(e.nbytes)
        store.add(e)
    store.touch(entries[0])  # used again: the second is now the oldest
    new = _entry(_ids(40, start=9000), size)
    assert store.make_room(new.nbytes)
    store.add(new)
    assert list(store.entries.values()) == [entries[2], entries[0], new]
    assert store.bytes == 3 * per <= store.budget and store.evicted == 1
    # the entry about to be restored is never evicted to make room
    assert store.make_room(2 * per, keep=entries[0])
    assert list(store.entries.values()) == [entries[0]]
    assert not store.make_room(3 * per, keep=entries[0])  # it would not fit beside it
    assert list(store.entries.values()) == [entries[0]]
    assert not PrefixStore(per - 1).make_room(per)  # a state larger than the whole budget


def test_the_budget_is_the_option_and_zero_is_off():
    assert budget_bytes(ServeOptions()) == 2 << 30
    assert budget_bytes(ServeOptions(prefix_cache=0)) == 0
    assert prefix_cache(object(), 0) is None
    with pytest.raises(BadInput, match="prefix_cache"):
        ServeOptions(prefix_cache=-1).validate()


def test_the_flag_takes_a_size_or_zero_and_refuses_the_rest_in_one_line(capsys, tmp_path):
    model = synth_model(tmp_path / "m.gguf", tiny_spec()).paths[0]
    code, out, _ = run_cli(capsys, "serve", "--help")
    assert code == 0 and "--prefix-cache" in out
    for bad in ("lots", "-1", "1.5", ""):
        code, out, err = run_cli(capsys, "serve", model, "--prefix-cache", bad)
        lines = err.strip().splitlines()
        assert code == 2 and out == "" and len(lines) == 1, (bad, err)
        assert lines[0].startswith("moepack: error: ") and "--prefix-cache" in lines[0]


# -- on llama.cpp ----------------------------------------------------------------------------

llama_cpp = pytest.importorskip("llama_cpp")

SYSTEM = " ".join(f"rule {i}: the tool t{i} reads the files of folder f{i}." for i in range(16))
SIDE = "You write a title of five words for the conversation."
ASK = [{"role": "user", "content": "list the rules about the folders f3 and f7"}]
MORE = "and now the rules about the folder f11, in the order they were given. " * 4


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("prefixcache")
    out = {}
    for arch in ("qwen3moe", "qwen35moe"):
        spec = tiny_spec(arch=arch, layers=4, experts=16, top_k=2, hidden=128, expert_ffn=64,
                         heads=4, kv_heads=2, head_dim=32, weight_type="Q8_0")  # fmt: skip
        out[arch] = synth_model(folder / f"{arch}.gguf", spec).paths[0]
    return out


class Counted:
    """A ``Llama`` with the tokens of each ``eval`` counted (the first of a request is the
    part of its prompt computed), and a prefix cache of ``budget`` bytes (0: none)."""

    def __init__(self, model: Path, budget: int, logits_all: bool = False) -> None:
        self.llm = llama_cpp.Llama(str(model), n_ctx=4096, n_batch=512, n_threads=1,
                                   verbose=False, chat_format="chatml",
                                   logits_all=logits_all)  # fmt: skip
        self.evals: list[int] = []
        inner = self.llm.eval

        def counting(tokens: Any) -> None:
            self.evals.append(len(tokens))
            inner(tokens)

        self.llm.eval = counting
        self.cache = prefix_cache(self.llm, budget)
        self.bias = {i: -100.0 for i in range(131, self.llm.n_vocab())}  # ASCII text

    def chat(
        self, system: str, messages: list[dict[str, str]], n: int = 16
    ) -> tuple[str, int, int]:
        """The greedy answer, its prompt's tokens and how many of them were computed."""
        self.evals.clear()
        r = self.llm.create_chat_completion(
            [{"role": "system", "content": system}, *messages],
            max_tokens=n, temperature=0, logit_bias=self.bias,
        )  # fmt: skip
        text = str(r["choices"][0]["message"]["content"])
        return text, int(r["usage"]["prompt_tokens"]), self.evals[0] if self.evals else 0

    def agent(self, side: bool = True) -> dict[str, Any]:
        """Turn 1, a side request (with ``side``) and turn 2 (turn 1's messages, a few hundred
        tokens more)."""
        a1, prompt1, computed1 = self.chat(SYSTEM, ASK)
        title = self.chat(SIDE, ASK, n=6)[0] if side else None
        turn2 = [*ASK, {"role": "assistant", "content": a1}, {"role": "user", "content": MORE}]
        a2, prompt2, computed2 = self.chat(SYSTEM, turn2)
        return {"a1": a1, "title": title, "a2": a2, "prompt1": prompt1, "prompt2": prompt2,
                "computed1": computed1, "computed2": computed2}  # fmt: skip

    def close(self) -> None:
        self.llm.close()


@pytest.fixture
def counted() -> Iterator[Any]:
    made: list[Counted] = []

    def make(model: Path, budget: int, logits_all: bool = False) -> Counted:
        made.append(Counted(model, budget, logits_all))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen35moe"])
def test_turn_two_after_a_side_request_computes_only_its_new_tokens(models, counted, arch):
    without = counted(models[arch], 0).agent()
    cached = counted(models[arch], 64 << 20)
    got = cached.agent()
    assert got == {**without, "computed2": got["computed2"]}  # the same text, every request
    assert got["computed1"] == got["prompt1"] > 800
    # without the cache the side request threw turn 1 away: turn 2 was computed from (about)
    # its start; with it, only what turn 2 adds
    assert without["computed2"] > got["prompt1"]
    # as little as turn 2 computes with no side request, cached or on llama-cpp-python's own
    # sequence (which a recurrent model cannot cut back to turn 1's prompt: it computes all)
    alone = counted(models[arch], 64 << 20).agent(side=False)
    own = counted(models[arch], 0).agent(side=False)
    assert alone["a2"] == own["a2"] == got["a2"]
    assert got["computed2"] == alone["computed2"] <= own["computed2"]
    if arch == "qwen35moe":  # the state kept is turn 1's prompt, from its first token out
        assert got["computed2"] == got["prompt2"] - got["prompt1"] < own["computed2"]
    snap = cached.cache.snapshot()
    assert snap["restored"] == 1 and snap["restored_tokens"] >= got["prompt1"]
    assert 0 < snap["bytes"] <= snap["budget_bytes"] and snap["failed"] == 0


@pytest.mark.slow
def test_a_budget_smaller_than_a_state_keeps_nothing_and_changes_nothing(models, counted):
    without = counted(models["qwen3moe"], 0).agent()
    tiny = counted(models["qwen3moe"], 4096)
    assert tiny.agent() == without
    snap = tiny.cache.snapshot()
    assert snap["entries"] == 0 and snap["refused"] >= 1 and snap["restored"] == 0


@pytest.mark.slow
def test_a_request_for_its_prompts_logprobs_is_computed_whole(models, counted):
    """``echo`` with ``logprobs`` reads the prompt's score rows, which a restore does not
    bring back: such a request is not given a cached prefix, and its logprobs are those of
    the same request on a model that never saw another prompt."""
    prompt = SYSTEM + " which folder does t5 read?"
    cached = counted(models["qwen3moe"], 64 << 20, logits_all=True)
    cached.llm.create_completion(prompt, max_tokens=4, temperature=0)
    cached.llm.create_completion(SIDE, max_tokens=4, temperature=0)
    got = cached.llm.create_completion(prompt, max_tokens=4, temperature=0, echo=True, logprobs=1)
    assert cached.cache.snapshot()["restored"] == 0
    fresh = counted(models["qwen3moe"], 0, logits_all=True)
    want = fresh.llm.create_completion(prompt, max_tokens=4, temperature=0, echo=True, logprobs=1)
    lp, wp = got["choices"][0]["logprobs"], want["choices"][0]["logprobs"]
    assert lp["tokens"] == wp["tokens"]
    assert np.allclose(lp["token_logprobs"][1:], wp["token_logprobs"][1:], atol=1e-4)
    # without echo the same prompt is restored
    cached.llm.create_completion(SIDE, max_tokens=4, temperature=0)
    before = cached.cache.snapshot()["restored"]
    again = cached.llm.create_completion(prompt, max_tokens=4, temperature=0, logprobs=1)
    assert cached.cache.snapshot()["restored"] == before + 1
    assert again["choices"][0]["text"] == want["choices"][0]["text"][len(prompt) :]
