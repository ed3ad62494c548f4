"""``moepack serve --draft``: the same greedy text through the ``openai`` client as without
drafts, and ``/metrics`` saying what drafting did."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint.synth import synth_model
from served import Served, logit_bias

pytest.importorskip("llama_cpp.server", reason="moepack[serve] is installed by ./dev test")
pytest.importorskip("openai", reason="the test extra installs the openai client")
pytestmark = pytest.mark.slow

ALIAS = "m"
PROMPT = "the quick brown fox jumps over the lazy dog and the quick brown fox jumps over the"
CHAT = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    spec = tiny_spec(layers=2, experts=16, top_k=4, hidden=128, expert_ffn=128, weight_type="Q8_0")
    return synth_model(tmp_path_factory.mktemp("sd") / f"{ALIAS}.gguf", spec).paths[0]


def _texts(server: Served, model: Path) -> list[str]:
    c = server.client()
    kw = {"model": ALIAS, "max_tokens": 20, "temperature": 0, "logit_bias": logit_bias(model)}
    out = [c.completions.create(prompt=PROMPT, **kw).choices[0].text]
    out.append("".join(ch.choices[0].text for ch in c.completions.create(
        prompt=PROMPT, stream=True, **kw)))  # fmt: skip
    out.append(c.chat.completions.create(messages=CHAT, **kw).choices[0].message.content or "")
    return out


def test_drafts_give_the_same_text_and_metrics_count_them(model, tmp_path):
    drafter = shutil.copy(model, tmp_path / "draft.gguf")  # the model drafting for itself
    with Served(model, "--ctx", 512, "--threads", 1) as plain:
        want = _texts(plain, model)
        base = plain.wait_idle()
    for args in (["--draft", "prompt-lookup:4"], ["--draft-model", drafter, "--draft", "model:4"]):
        with Served(model, "--ctx", 512, "--threads", 1, "--prefetch", *args) as s:
            assert _texts(s, model) == want, args
            m = s.wait_idle()
        drafted = m['moepack_draft_tokens_total{kind="drafted"}']
        accepted = m['moepack_draft_tokens_total{kind="accepted"}']
        assert drafted > 0 and 0 <= accepted <= drafted, args
        if "--draft-model" in args:
            assert accepted > 0  # the model drafting for itself is right
        assert m["moepack_draft_acceptance_ratio"] == pytest.approx(accepted / drafted)
        assert m['moepack_draft_passes_total{kind="verify"}'] > 0
        # rejected drafts are not output: decode counts the tokens kept, as without drafts
        # (an accepted last draft was computed where plain decoding stops before it)
        plain_decode = base['moepack_tokens_total{phase="decode"}']
        decode = m['moepack_tokens_total{phase="decode"}']
        assert plain_decode <= decode <= plain_decode + 3, args


def test_serve_refuses_bad_drafting_in_one_line(model, tmp_path, capsys):
    other = synth_model(tmp_path / "other.gguf", tiny_spec(vocab=300)).paths[0]
    cases: list[tuple[list[object], str]] = [
        (["--draft", "mtp"], "cannot run MTP drafts"),
        (["--draft-model", other], "not a draft for this model"),
        (["--draft", "prompt-lookup", "--trace-out", tmp_path / "t.moetrace"], "without --draft"),
    ]
    for args, why in cases:
        code, out, err = run_cli(capsys, "serve", model, "--port", 0, *args)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert why in err
