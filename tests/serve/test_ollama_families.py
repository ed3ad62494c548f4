"""Ollama's streamed text is its plain text on every synthetic family (``test_ollama`` runs
every route on qwen3moe and qwen35moe): chat and generate through the ``ollama`` client, every
byte token allowed, so a character's bytes fall in two tokens wherever the random weights put
them (``serve.textstream`` streams what the plain answer decodes)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from moefixtures import tiny_spec
from moepack.checkpoint.archs import arch_names
from moepack.checkpoint.synth import synth_model
from served import Served

pytest.importorskip("llama_cpp.server", reason="moepack[serve] is installed by ./dev test")
ollama = pytest.importorskip("ollama", reason="the test extra installs the ollama client")
pytestmark = pytest.mark.slow

COVERED = ("qwen3moe", "qwen35moe")  # every route, in test_ollama
SIZES = dict(layers=3, experts=8, top_k=2, hidden=64, expert_ffn=32, heads=2, kv_heads=1,
             head_dim=32)  # fmt: skip
GREEDY = {"temperature": 0, "seed": 7, "num_predict": 32}
USER = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog"}]


@pytest.fixture(scope="module", params=[a for a in arch_names() if a not in COVERED])
def client(request, tmp_path_factory) -> Iterator[Any]:
    arch = request.param
    path = synth_model(tmp_path_factory.mktemp(arch) / "m.gguf",
                       tiny_spec(arch=arch, seed=4, **SIZES)).paths[0]  # fmt: skip
    with Served(path, "--ctx", 512, "--threads", 1) as s:
        yield ollama.Client(host=s.base, timeout=600)


def test_streamed_text_is_the_plain_text(client):
    plain = client.chat(model="m", messages=USER, options=GREEDY)
    streamed = list(client.chat(model="m", messages=USER, options=GREEDY, stream=True))
    assert "".join(c.message.content for c in streamed) == plain.message.content
    assert streamed[-1].done and streamed[-1].eval_count == plain.eval_count
    gen = client.generate(model="m", prompt="the quick brown fox", options=GREEDY)
    parts = list(client.generate(model="m", prompt="the quick brown fox", options=GREEDY,
                                 stream=True))  # fmt: skip
    assert "".join(p.response for p in parts) == gen.response
    assert parts[-1].done and parts[-1].eval_count == gen.eval_count
    assert plain.eval_count > 0 and gen.eval_count > 0
