"""``moepack run``: generation in llama.cpp, the prefetch changes no number, bad input is one
line."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from moefixtures import run_cli, tiny_spec, write_gguf
from moepack.checkpoint import MoeModel
from moepack.checkpoint.synth import synth_model
from moepack.layout.plan import LayerPlan, Plan
from moepack.llama.prefetcher.streamer import StreamOptions
from moepack.llama.runtime.run import RunOptions, run_model
from moepack.rewrite.repack import repack

pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
pytestmark = pytest.mark.slow

PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    spec = tiny_spec(layers=4, experts=32, top_k=4, hidden=256, expert_ffn=256, weight_type="Q8_0")
    return synth_model(d / "m.gguf", spec).paths[0]


@pytest.fixture(scope="module")
def repacked(model, tmp_path_factory):
    with MoeModel(model) as m:
        rng = np.random.default_rng(2)
        plan = Plan(
            [LayerPlan(b.index, rng.permutation(b.n_expert)) for b in m.blocks], m.fingerprint
        )
    return repack(model, plan, tmp_path_factory.mktemp("rp") / "r.gguf").outputs[0]


def _opts(
    prefetch: bool = False,
    engine: str = "threads",
    queue_depth: int = 8,
    mode: str = "overlap",
    no_readaround: bool = False,
    **kw,
):
    """RunOptions from the flat keywords these tests use."""
    pf = StreamOptions(mode=mode, engine=engine, queue_depth=queue_depth) if prefetch else None
    return RunOptions(prefetch=pf, readaround="off" if no_readaround else "auto", **kw)


def _logits(path, tmp_path, name, **kw):
    out = tmp_path / f"{name}.npy"
    r = run_model(path, PROMPT, _opts(n_predict=12, threads=1, **kw), logits_out=out)
    return r, np.load(out)


@pytest.mark.parametrize("mode", ["overlap", "serial"])
@pytest.mark.parametrize("which", ["original", "repacked"])
def test_prefetch_leaves_every_logit_bit_identical(which, mode, model, repacked, tmp_path):
    path = model if which == "original" else repacked
    stock, a = _logits(path, tmp_path, "stock", cold=True)
    pre, b = _logits(
        path,
        tmp_path,
        "pre",
        cold=True,
        prefetch=True,
        mode=mode,
        engine="threads",
        queue_depth=4,
    )
    assert a.shape == (13, 262) and np.array_equal(a, b)
    assert stock.generated == pre.generated and len(pre.generated) == 12
    # the prefetch really ran: it read experts after the cold start and was timed
    dec = pre.decode.to_json()
    # every pass routes at 4 layers, except passes run with the callback off because the
    # whole file was resident by then
    skipped = pre.decode.prefetch["passes_all_resident"]
    assert pre.decode.prefetch["calls"] == 4 * (12 - skipped) and skipped < 12
    assert pre.decode.prefetch["bytes_read"] > 0 and dec["prefetch_seconds"] > 0
    assert stock.decode.prefetch.get("calls", 0) == 0
    assert pre.cached_after_evict is not None and pre.cached_after_evict < path.stat().st_size


STREAMS = {
    "router-c": StreamOptions(),
    "none": StreamOptions(lookahead="none"),
    "cross-layer+markov": StreamOptions(lookahead="cross-layer+markov"),  # Python, online
    "depth-2": StreamOptions(lookahead_depth=2, lookahead_budget=8),
    "small-cache": StreamOptions(cache=6 * 3 * 278528),  # evictions on every token
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("config", list(STREAMS))
def test_every_prefetch_configuration_leaves_every_logit_bit_identical(
    config, threads, model, tmp_path
):
    out_a, out_b = tmp_path / "a.npy", tmp_path / "b.npy"
    base = RunOptions(n_predict=10, threads=threads, cold=True)
    stock = run_model(model, PROMPT, base, logits_out=out_a)
    pre = run_model(model, PROMPT, replace(base, prefetch=STREAMS[config]), logits_out=out_b)
    assert np.array_equal(np.load(out_a), np.load(out_b))
    assert stock.generated == pre.generated
    assert pre.decode.prefetch["calls"] > 0  # the cold start made it work
    if config == "small-cache":
        assert pre.stream is not None and pre.stream["cache"]["policy"] == "lru"
        assert pre.decode.prefetch["cache_evictions"] > 0


def test_the_python_fallbacks_leave_every_logit_bit_identical(model, tmp_path, monkeypatch):
    """Without a C compiler: the Python gate, read-ahead thread and demand handler."""
    monkeypatch.setenv("MOEPACK_NO_C_GATE", "1")
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    base = RunOptions(n_predict=8, threads=1, cold=True)
    run_model(model, PROMPT, base, logits_out=a)
    r = run_model(model, PROMPT, replace(base, prefetch=StreamOptions()), logits_out=b)
    assert np.array_equal(np.load(a), np.load(b))
    assert r.stream is not None
    assert r.stream["fetcher"] == "python" and r.stream["callback"] == "python"
    assert r.decode.prefetch["calls"] > 0


def test_no_readaround_changes_no_number(model, tmp_path):
    _, a = _logits(model, tmp_path, "a")
    r, b = _logits(
        model, tmp_path, "b", no_readaround=True, prefetch=True, engine="pread", queue_depth=1
    )
    assert np.array_equal(a, b)
    with MoeModel(model) as m:
        matrices = sum(t.entry.n_bytes for b in m.blocks for t in b.weight_tensors)
    assert r.no_readaround_bytes == matrices


def test_readaround_auto_follows_the_live_cache(model, tmp_path):
    """``auto`` turns read-around off only where the live cache manages the experts: a model
    that fits keeps the kernel's (a page evicted by others comes back with its neighbours)."""
    fits = run_model(model, PROMPT, _opts(prefetch=True, n_predict=4, threads=1))
    assert fits.stream is not None and fits.stream["cache"]["policy"] == "kernel"
    assert fits.no_readaround_bytes == 0
    pf = StreamOptions(mode="overlap", cache=8 << 20)
    live = run_model(model, PROMPT, RunOptions(prefetch=pf, n_predict=4, threads=1))
    assert live.stream is not None and live.stream["cache"]["policy"] == "lru"
    with MoeModel(model) as m:
        matrices = sum(t.entry.n_bytes for b in m.blocks for t in b.weight_tensors)
    assert live.no_readaround_bytes == matrices


def test_cli_prints_text_and_the_measurements(capsys, model):
    code, out, err = run_cli(
        capsys, "run", model, "--prompt", PROMPT, "--n-predict", 4, "--prefetch", "--threads", 1
    )
    assert code == 0, err
    assert "tokens/s" in out and "major faults/token" in out and "overlapped prefetch" in out
    code, out, err = run_cli(
        capsys, "run", model, "--prompt", PROMPT, "--n-predict", 2, "--prefetch",
        "--prefetch-mode", "serial", "--threads", 1,
    )  # fmt: skip
    assert code == 0, err
    assert "serial prefetch with threads" in out
    code, out, err = run_cli(
        capsys, "run", model, "--prompt", PROMPT, "--n-predict", 3, "--json", "--threads", 1
    )
    assert code == 0, err
    j = json.loads(out)
    assert j["generated_tokens"] == 3 and j["decode"]["tokens_per_second"] > 0
    assert set(j["decode"]) >= {
        "bytes_read_per_token",
        "major_faults_per_token",
        "prefetch_seconds",
    }


def test_a_prompt_file_runs_its_prompts_in_order_each_from_an_empty_context(
    capsys, model, tmp_path
):
    pf = tmp_path / "p.jsonl"
    pf.write_text(json.dumps({"prompt": PROMPT}) + "\n" + json.dumps({"prompt": "second"}) + "\n")
    code, out, err = run_cli(capsys, "run", model, "--prompt-file", pf, "-n", 3, "--json")
    assert code == 0, err
    j = json.loads(out)
    alone = [run_model(model, p, _opts(n_predict=3, threads=2)) for p in (PROMPT, "second")]
    assert [p["generated"] for p in j["prompts"]] == [a.generated for a in alone]
    assert [p["prompt_tokens"] for p in j["prompts"]] == [a.prompt_tokens for a in alone]
    assert j["prompt_tokens"] == sum(a.prompt_tokens for a in alone)
    assert j["decode"]["tokens"] == sum(len(a.generated) for a in alone)
    # plain lines are prompts too, exactly as trace capture reads them
    txt = tmp_path / "p.txt"
    txt.write_text(PROMPT + "\n\nsecond\n")
    code, out2, err = run_cli(capsys, "run", model, "--prompt-file", txt, "-n", 3, "--json")
    assert code == 0, err
    assert json.loads(out2)["prompts"] == j["prompts"]


def test_a_traced_run_of_two_prompts_streams_per_prompt_routing(model, tmp_path):
    from moepack.llama.runtime.capture import token_phases, token_prompts
    from moepack.llama.runtime.prompts import Prompt
    from moepack.trace import load_trace

    out = tmp_path / "two.moetrace"
    prompts = [Prompt(text=PROMPT), Prompt(text="second")]
    r = run_model(model, prompts, _opts(n_predict=4, threads=1, prefetch=True), trace_out=out)
    assert [p.name for p in tmp_path.iterdir()] == ["two.moetrace"]  # the spool is gone
    single = tmp_path / "single.moetrace"
    r2 = run_model(model, "second", _opts(n_predict=4, threads=1), trace_out=single)
    with MoeModel(model) as m:
        t = load_trace(out, model=m)
        t2 = load_trace(single, model=m)
    n0 = r.prompts[0].prompt_tokens + len(r.prompts[0].generated)
    assert t.tokens == n0 + r.prompts[1].prompt_tokens + len(r.prompts[1].generated)
    assert token_prompts(t).tolist() == [0] * n0 + [1] * (t.tokens - n0)
    phases = token_phases(t)
    assert phases[: r.prompts[0].prompt_tokens].tolist() == [0] * r.prompts[0].prompt_tokens
    assert phases[n0 : n0 + r.prompts[1].prompt_tokens].sum() == 0
    # the second prompt routed as it does alone: it started from an empty context
    assert r.prompts[1].generated == r2.generated
    np.testing.assert_array_equal(np.asarray(t.ids[n0:]), np.asarray(t2.ids))


def test_engine_that_cannot_serve_the_depth_falls_back_with_one_line(capsys, model):
    code, out, err = run_cli(
        capsys,
        "run",
        model,
        "--prompt",
        "hi",
        "--n-predict",
        1,
        "--prefetch",
        "--prefetch-mode",
        "serial",
        "--engine",
        "pread",
        "--qd",
        4,
        "--json",
    )
    assert code == 0, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("moepack: warning: engine 'pread'")
    assert json.loads(out)["stream"]["engine"] == "threads"


def test_bad_input_is_one_line(capsys, model, tmp_path):
    dense = write_gguf(
        tmp_path / "dense.gguf",
        "llama",
        {"token_embd.weight": (8, 4), "blk.0.attn_q.weight": (4, 4)},
        {"llama.block_count": 1},
    )
    long_prompt = " ".join(["word"] * 200)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    cases = [
        (["run", tmp_path / "missing.gguf", "--prompt", "x"], "no such file"),
        (["run", dense, "--prompt", "x"], "not a MoE model"),
        (["run", model, "--prompt", "   "], "the prompt is empty"),
        (["run", model], "give a workload"),
        (["run", model, "--prompt-file", empty], "holds no prompts"),
        (["run", model, "--prompt", "x", "--chat"], "no chat template"),
        (["run", model, "--prompt", "x", "--prefetch", "--engine", "nope"], "unknown engine"),
        (["run", model, "--prompt", long_prompt, "--ctx", 64], "longer than the context"),
    ]
    for args, message in cases:
        code, out, err = run_cli(capsys, *args)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2, (args, err)
        assert len(lines) == 1 and message in lines[0], (args, err)


def test_trace_records_every_token_at_every_layer(model, tmp_path):
    from moepack.trace import load_trace

    out = tmp_path / "run.moetrace"
    r = run_model(model, PROMPT, _opts(n_predict=5, threads=1, prefetch=True), trace_out=out)
    with MoeModel(model) as m:
        t = load_trace(out, model=m)
        assert t.ids.shape == (r.prompt_tokens + 5, len(m.blocks), m.top_k)
        assert t.prefill_tokens == r.prompt_tokens
        assert t.model_fingerprint == m.fingerprint
        assert t.ids.min() >= 0 and t.ids.max() < m.n_expert
        # top-k ids of one token at one layer are distinct
        assert all(len(set(row)) == m.top_k for row in t.ids.reshape(-1, m.top_k))


@pytest.mark.parametrize("use_gate", [True, False], ids=["c-gate", "python"])
def test_the_switch_turns_the_callback_off_between_passes(model, use_gate):
    import os
    import shutil

    from moepack.llama.prefetcher.evalcb import EvalCallback
    from moepack.llama.runtime.session import LlamaSession, SessionParams

    seen: list[tuple[str, int]] = []
    cb = EvalCallback(
        ["ffn_moe_topk"], lambda n, layer, a: seen.append((n, layer)), use_gate=use_gate
    )
    if use_gate and not os.environ.get("CC") and (shutil.which("cc") or shutil.which("gcc")):
        assert cb.kind == "c-gate"
    params = SessionParams(n_ctx=64, n_batch=16, n_ubatch=16)
    s = LlamaSession(str(model), params, cb)
    s.decode([1, 7, 9], 0, all_logits=False)
    assert seen == [("ffn_moe_topk", i) for i in range(4)]
    if cb.kind == "c-gate":
        assert cb.asked > 4 * 10  # every node was asked
    on = s.decode([11], 3, all_logits=False)
    cb.enabled = False
    asked = cb.asked
    s.clear()
    s.decode([1, 7, 9], 0, all_logits=False)
    off = s.decode([11], 3, all_logits=False)
    assert len(seen) == 8 and cb.asked == asked
    assert np.array_equal(on, off)  # the switch changes no number
    cb.enabled = True
    s.decode([12], 4, all_logits=False)
    assert len(seen) == 12
    s.close()


ARCH_CASES = [
    ("qwen2moe", {}),
    ("mixtral", {}),
    ("gpt-oss", {}),
    ("deepseek2", {}),
    ("deepseek2", {"fused_gate_up": True}),
]


@pytest.mark.parametrize(("arch", "extra"), ARCH_CASES, ids=lambda v: str(v))
def test_every_family_runs_with_the_prefetch_and_the_same_logits(arch, extra, tmp_path):
    from moepack.checkpoint.archs import arch_names

    if arch not in arch_names():
        pytest.skip(f"{arch} is not a synthetic family here")
    spec = tiny_spec(  # 40 MB: more than one 8 MiB fault read-around
        layers=3,
        experts=64,
        top_k=4,
        hidden=256,
        expert_ffn=256,
        heads=4,
        head_dim=64,
        weight_type="Q8_0",
        arch=arch,
        **extra,
    )
    path = synth_model(tmp_path / "m.gguf", spec).paths[0]
    stock, a = _logits(path, tmp_path, "stock", cold=True)
    pre, b = _logits(path, tmp_path, "pre", cold=True, prefetch=True, queue_depth=4)
    assert np.array_equal(a, b)
    with MoeModel(path) as m:
        kinds = {t.kind for blk in m.blocks for t in blk.weight_tensors}
        n_moe = len(m.blocks)
    if extra.get("fused_gate_up"):
        assert "gate_up" in kinds
    skipped = pre.decode.prefetch["passes_all_resident"]
    assert pre.decode.prefetch["calls"] == n_moe * (12 - skipped) and skipped < 12
    assert pre.decode.prefetch["bytes_read"] > 0  # it read experts after the cold start


def test_a_model_that_changed_since_it_was_opened_is_one_line(model, tmp_path):
    import os
    import shutil

    from moepack.errors import BadInput
    from moepack.llama.runtime.identity import FileIdentity

    copy = tmp_path / "c.gguf"
    shutil.copy(model, copy)
    seen = [FileIdentity.of(copy)]
    os.utime(copy, ns=(1, 1))  # rewritten after the caller looked at it
    with pytest.raises(BadInput, match="changed since it was opened"):
        run_model(copy, PROMPT, _opts(n_predict=2, threads=1, prefetch=True), expect=seen)


def test_a_split_checkpoint_is_prefetched_shard_by_shard(model, tmp_path):
    spec = tiny_spec(layers=4, experts=32, top_k=4, hidden=256, expert_ffn=256, weight_type="Q8_0")
    shards = synth_model(tmp_path / "s.gguf", spec, split_max_size=8 << 20).paths
    assert len(shards) > 2
    stock, a = _logits(shards[0], tmp_path, "stock", cold=True)
    pre, b = _logits(shards[0], tmp_path, "pre", cold=True, prefetch=True, no_readaround=True)
    assert np.array_equal(a, b)
    _, c = _logits(model, tmp_path, "whole")  # the same weights in one file
    assert np.array_equal(a, c)
    assert pre.decode.prefetch["bytes_read"] > 0
    with MoeModel(shards[0]) as m:
        matrices = sum(t.entry.n_bytes for blk in m.blocks for t in blk.weight_tensors)
    assert pre.no_readaround_bytes == matrices  # advice reached every shard's mapping


def test_a_continuation_is_decoded_instead_of_generated(model, tmp_path):
    from moepack.errors import BadInput

    text = "over the lazy dog and back again over the hill"
    a = run_model(model, PROMPT, _opts(n_predict=6, threads=1), continuation=text)
    b = run_model(model, PROMPT, _opts(n_predict=6, threads=1, prefetch=True), continuation=text)
    greedy = run_model(model, PROMPT, _opts(n_predict=6, threads=1))
    assert a.generated == b.generated and len(a.generated) == 6
    assert a.generated != greedy.generated
    with pytest.raises(BadInput, match=r"fewer than `n_predict` \(6\)"):
        run_model(model, PROMPT, _opts(n_predict=6, threads=1), continuation="x")
