"""Drafted tokens verified a pass at a time: greedy output is the model's own, token for
token, on every synthetic family; the logits differ from one-by-one decoding by at most the
documented bound; the prefetcher counts the union a verification batch reads; bad drafting
input is one line."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint.synth import synth_model
from moepack.errors import BadInput
from moepack.llama.prefetcher.streamer import StreamOptions
from moepack.llama.runtime.draft import LOGIT_BOUND, DraftOptions
from moepack.llama.runtime.run import RunOptions, run_model

pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
pytestmark = pytest.mark.slow

PROMPT = "the quick brown fox jumps over the lazy dog and the quick brown fox"
N = 16


def _family(tmp_path, arch: str, **kw):
    spec = tiny_spec(layers=2, experts=16, top_k=4, hidden=128, expert_ffn=128, heads=4,
                     head_dim=32, weight_type="Q8_0", arch=arch, **kw)  # fmt: skip
    return synth_model(tmp_path / f"{arch}.gguf", spec).paths[0]


def _run(path, tmp_path, name, draft=None, **kw):
    out = tmp_path / f"{name}.npy"
    r = run_model(path, PROMPT, RunOptions(n_predict=N, threads=1, draft=draft or DraftOptions(), **kw),
                  logits_out=out)  # fmt: skip
    return r, np.load(out)


def _within_bound(a: np.ndarray, b: np.ndarray) -> None:
    scale = np.abs(a).max(axis=1)
    worst = (np.abs(a - b).max(axis=1) / scale).max()
    assert worst <= LOGIT_BOUND, f"logits differ by {worst:.3%} of the largest"


@pytest.mark.parametrize(
    "arch", ["qwen3moe", "deepseek2", "glm4moe", "gpt-oss", "mistral4", "mixtral", "qwen2moe"]
)
def test_greedy_tokens_are_the_same_with_drafts_on_every_family(arch, tmp_path):
    from moepack.checkpoint.archs import arch_names

    if arch not in arch_names():
        pytest.skip(f"{arch} is not a synthetic family here")
    path = _family(tmp_path, arch)
    plain, a = _run(path, tmp_path, "plain")
    lookup, b = _run(path, tmp_path, "lookup", DraftOptions("prompt-lookup", 6))
    # the model drafting for itself: every draft is the model's choice, so the verification
    # passes are long and their logits are the ones compared with one-by-one decoding
    selfish = DraftOptions("model", 5, str(path), adaptive=False)
    itself, c = _run(path, tmp_path, "itself", selfish)
    assert lookup.generated == plain.generated == itself.generated
    assert lookup.decode.draft["verify_passes"] >= 1  # the prompt repeats: lookup drafted
    d = itself.decode.draft
    assert d["accepted"] == d["drafted"] > 0 and d["verify_passes"] >= 2
    assert a.shape == b.shape == c.shape
    _within_bound(a, b)
    _within_bound(a, c)


def test_a_verification_batch_reads_the_union_of_its_experts_once(tmp_path):
    import shutil

    path = _family(tmp_path, "qwen3moe")
    # a copy drafts: its reads do not bring the target's pages back after the cold drop
    copy = shutil.copy(path, tmp_path / "copy.gguf")
    selfish = DraftOptions("model", 5, str(copy), adaptive=False)
    plain, a = _run(path, tmp_path, "plain", prefetch=StreamOptions(), cold=True)
    r, b = _run(path, tmp_path, "drafted", selfish, prefetch=StreamOptions(), cold=True)
    assert r.generated == plain.generated
    _within_bound(a, b)
    d = r.decode.to_json()["draft"]
    assert d["verify_passes"] >= 2 and d["acceptance_rate"] == 1.0
    # every row of every verification pass routes top-k experts per layer (the cache
    # residency switch may have turned the callback off for some passes: at most)
    routed = d["verify_routed"]
    assert 0 < routed <= (d["verify_passes"] + d["drafted"]) * 4 * 2
    assert 0 < d["verify_union_experts"] < routed  # shared experts read once
    assert d["experts_per_verified_batch"] < d["routed_per_verified_batch"] <= 6 * 4
    assert d["bytes_per_accepted_token"] == r.decode.to_json()["bytes_read_per_token"]


def test_a_traced_drafted_run_records_only_the_tokens_kept(tmp_path):
    from moepack.trace import load_trace

    path = _family(tmp_path, "qwen3moe")
    opts = RunOptions(n_predict=N, threads=1)
    a = run_model(path, PROMPT, opts, trace_out=tmp_path / "a.moetrace")
    draft = DraftOptions("model", 4, str(path), adaptive=False)
    b = run_model(path, PROMPT, RunOptions(n_predict=N, threads=1, draft=draft),
                  trace_out=tmp_path / "b.moetrace")  # fmt: skip
    assert a.generated == b.generated
    assert a.trace is not None and b.trace is not None
    ta, tb = load_trace(a.trace), load_trace(b.trace)
    assert np.asarray(ta.ids).shape == np.asarray(tb.ids).shape
    assert np.array_equal(np.asarray(ta.ids), np.asarray(tb.ids))


def test_cli_reports_drafts_in_json_and_refuses_bad_drafting_in_one_line(tmp_path, capsys):
    path = _family(tmp_path, "qwen3moe")
    code, out, _ = run_cli(capsys, "run", str(path), "-p", PROMPT, "-n", "8", "-t", "1",
                           "--draft", "prompt-lookup:3", "--json")  # fmt: skip
    assert code == 0
    j = json.loads(out)
    assert j["draft"]["kind"] == "prompt-lookup" and j["draft"]["length"] == 3
    assert j["decode"]["draft"]["drafted"] >= j["decode"]["draft"]["accepted"] >= 0
    other = synth_model(tmp_path / "other.gguf", tiny_spec(vocab=300)).paths[0]
    for args, why in [
        (["--draft", "mtp"], "cannot run MTP drafts"),
        (["--draft", "lookahead"], "`draft` is one of|--draft is one of"),
        (["--draft", "prompt-lookup:0"], "a draft is 1 to 64 tokens"),
        (["--draft-model", str(other)], "not a draft for this model: its vocabulary has 300"),
        (["--draft-model", str(tmp_path / "none.gguf")], "no such file"),
    ]:
        code, out, err = run_cli(capsys, "run", str(path), "-p", "x", *args)
        assert code == 2 and out == "", args
        assert len(err.strip().splitlines()) == 1 and why.split("|")[-1] in err, err
    with pytest.raises(BadInput, match="not a draft for this model"):
        run_model(path, "x", RunOptions(draft=DraftOptions("model", 4, str(other))))


def test_the_library_hook_drafts_on_a_llama_of_ones_own(tmp_path):
    from llama_cpp import Llama

    from moepack.llama import drafting

    path = _family(tmp_path, "qwen3moe")

    def make() -> Llama:
        return Llama(str(path), n_ctx=256, n_threads=1, verbose=False)

    def text(llm: Llama) -> str:
        out: Any = llm.create_completion(PROMPT, max_tokens=N, temperature=0.0)
        return str(out["choices"][0]["text"])

    want = text(make())
    llm = make()
    hook = drafting(llm, DraftOptions("model", 4, str(path), adaptive=False))
    assert text(llm) == want
    d = hook.snapshot()
    assert d["drafted"] > 0 and d["accepted"] > 0 and d["verify_passes"] > 0
    hook.detach()
    assert llm.draft_model is None
    assert text(llm) == want
