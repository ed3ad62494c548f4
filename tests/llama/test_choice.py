"""What runs a model when no flag says (``llama.runtime.choice``): llama.cpp's defaults where
the model fits, the prefetcher with the pager where it does not (one line saying so), the
flags choosing otherwise; the same choice in ``run``, ``serve`` and ``streaming_llama``; and
the memory available as a container's limit leaves it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint.model import MoeModel
from moepack.checkpoint.synth import synth_model
from moepack.errors import BadInput
from moepack.llama.prefetcher.pager import minimum_budget
from moepack.llama.prefetcher.pinning import dense_ranges
from moepack.llama.prefetcher.prefetch import ExpertRanges
from moepack.llama.prefetcher.streamer import MARGIN, StreamOptions, wants_pager
from moepack.llama.runtime.choice import AutoStream, choose_streaming, pager_works
from moepack.llama.runtime.memory_plan import (
    RUNTIME_BYTES,
    context_needs,
    rough_context_bytes,
)
from moepack.storage.linux import cgroup_headroom

GIB = 1 << 30
PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    spec = tiny_spec(layers=3, experts=16, top_k=4, hidden=256, expert_ffn=256, weight_type="Q8_0")
    return synth_model(tmp_path_factory.mktemp("choice") / "m.gguf", spec).paths[0]


def half_the_experts(model: Path, n_ctx: int = 4096) -> int:
    """A --memory holding the run and its context but only half the routed experts."""
    (need,) = context_needs(model, [n_ctx])
    with MoeModel(model) as m:
        dense = sum(r.length for r in dense_ranges(m))
        return RUNTIME_BYTES + need.bytes + dense + m.expert_bytes // 2


def test_a_model_that_fits_runs_llama_cpp_alone_and_one_that_does_not_streams(model):
    roomy = choose_streaming(model, AutoStream(), available=64 * GIB)
    assert roomy.prefetch is None and roomy.engine == "llama.cpp" and roomy.note is None
    assert roomy.plan is not None and roomy.plan.fits
    tight = choose_streaming(model, AutoStream(), available=MARGIN + half_the_experts(model))
    plan = tight.plan
    assert plan is not None and not plan.fits and plan.experts > 0
    # the experts get what the plan leaves them, as a hard budget
    assert tight.prefetch == StreamOptions(memory=plan.experts)
    assert tight.engine == ("pager" if pager_works() else "page cache")
    assert tight.note is not None and "do not fit" in tight.note and "\n" not in tight.note
    # what the plan counts: the file's dense bytes, llama.cpp's context, the run itself
    assert plan.dense + plan.reserve + plan.experts == plan.total
    assert plan.context.state_bytes > 0 and plan.context.compute_bytes > 0


def test_the_flags_choose_otherwise(model):
    asked = StreamOptions(pager="off")
    on = choose_streaming(model, asked, available=64 * GIB)
    assert on.prefetch is asked and on.engine == "page cache" and on.note is None
    off = choose_streaming(model, None, available=1)
    assert off.prefetch is None and off.engine == "llama.cpp" and off.plan is None
    # a --memory smaller than the model and its context streams where the model would fit
    small = half_the_experts(model)
    budget = choose_streaming(model, AutoStream(), memory=small, available=64 * GIB)
    assert budget.plan is not None and budget.plan.asked and budget.plan.total == small
    assert budget.prefetch == StreamOptions(memory=budget.plan.experts)
    # the prefetcher's own memory bounds the experts further, never more
    less = choose_streaming(model, AutoStream(StreamOptions(memory=1 << 20)), memory=small)
    assert less.prefetch is not None and less.prefetch.memory == 1 << 20
    assert "do not fit in `memory`" in (budget.note or "")  # --memory on the command line


def test_a_memory_too_small_for_the_context_is_refused_naming_the_context_that_fits(model):
    need = context_needs(model, [4096, 512])
    # KV grows with the context (llama.cpp prints sizes to 0.01 MiB)
    assert need[0].state_bytes == pytest.approx(8 * need[1].state_bytes, abs=8 * 5243)
    with MoeModel(model) as m:
        least = minimum_budget(ExpertRanges(m), 1)
        dense = sum(r.length for r in dense_ranges(m))
    # room for the experts and a 512-token context, not for 4096 tokens
    memory = dense + RUNTIME_BYTES + least + need[1].bytes + 1024
    with pytest.raises(BadInput) as e:
        choose_streaming(model, AutoStream(), memory=memory, n_ctx=4096)
    message = e.value.message
    assert (
        "\n" not in message and "`memory` is" in message and "a context of 4096 tokens" in message
    )
    fit = int(message.rsplit("`n_ctx` ", 1)[1].split()[0])
    assert 512 <= fit < 4096
    ok = choose_streaming(model, AutoStream(), memory=memory, n_ctx=fit)
    assert ok.plan is not None and ok.plan.experts >= least


def test_a_prefix_cache_too_large_is_refused_naming_the_one_that_fits(model):
    (need,) = context_needs(model, [512])
    with MoeModel(model) as m:
        least = minimum_budget(ExpertRanges(m), 1)
        dense = sum(r.length for r in dense_ranges(m))
    # room for the experts, the context and 100 MiB of prefixes, not for 1 GiB of them
    memory = dense + RUNTIME_BYTES + least + need.bytes + 100 * (1 << 20)
    with pytest.raises(BadInput) as e:
        choose_streaming(model, AutoStream(), memory=memory, n_ctx=512, prefix_cache=GIB)
    message = e.value.message
    assert "\n" not in message and "a 1.0 GiB prefix cache" in message
    size = int(message.rsplit("`prefix_cache` ", 1)[1].split("M at this context")[0])
    assert 90 <= size <= 100
    ok = choose_streaming(model, AutoStream(), memory=memory, n_ctx=512, prefix_cache=size << 20)
    assert ok.plan is not None and ok.plan.experts >= least


def test_llama_cpp_counts_the_kv_cache_as_its_shape_says(model):
    (need,) = context_needs(model, [1024])
    spec = tiny_spec(layers=3, experts=16, top_k=4, hidden=256, expert_ffn=256)
    # f16 K and V for every layer, token and KV head
    exact = spec.layers * 1024 * spec.kv_heads * spec.head_dim * 2 * 2
    assert need.state_bytes == pytest.approx(exact, abs=5243)  # printed to 0.01 MiB
    assert rough_context_bytes_of(model, 1024) >= need.bytes


def rough_context_bytes_of(path: Path, n_ctx: int) -> int:
    with MoeModel(path) as m:
        return rough_context_bytes(m, n_ctx, 512)


def test_the_pager_takes_what_does_not_fit_unless_told_otherwise():
    gb = 1 << 30
    assert wants_pager(StreamOptions(), 17 * gb, 12 * gb)
    assert not wants_pager(StreamOptions(), 3 * gb, 12 * gb)
    assert not wants_pager(StreamOptions(pager="off"), 17 * gb, 12 * gb)
    assert wants_pager(StreamOptions(pager="on"), 3 * gb, 12 * gb)
    assert wants_pager(StreamOptions(memory=2 * gb), 3 * gb, 12 * gb)
    assert not wants_pager(StreamOptions(memory=4 * gb), 3 * gb, 1 * gb)


def _cgroup(tmp_path: Path, v1: bool, limit: str, usage: int, files: dict[str, int]) -> Path:
    base = tmp_path / ("memory" if v1 else "") / "box"
    base.mkdir(parents=True)
    (base / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(limit + "\n")
    (base / ("memory.usage_in_bytes" if v1 else "memory.current")).write_text(f"{usage}\n")
    (base / "memory.stat").write_text("".join(f"{k} {v}\n" for k, v in files.items()))
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/box\n" if v1 else "0::/box\n")
    return proc


@pytest.mark.parametrize("v1", [False, True], ids=["v2", "v1"])
def test_a_container_limit_is_the_memory_available(tmp_path, v1):
    files = (
        {"total_inactive_file": 1 * GIB, "total_active_file": 1 * GIB, "anon": 5}
        if v1
        else {"anon": 5, "file": 2 * GIB}
    )
    proc = _cgroup(tmp_path, v1, str(8 * GIB), 7 * GIB, files)
    # 8 GiB limit, 7 used of which 2 are file pages the kernel reclaims first: 3 GiB left
    assert cgroup_headroom(str(tmp_path), str(proc)) == 3 * GIB


@pytest.mark.parametrize("limit", ["max", "9223372036854771712"])
def test_no_limit_leaves_the_machine_s_figure(tmp_path, limit):
    v1 = limit != "max"
    proc = _cgroup(tmp_path, v1, limit, 1, {})
    assert cgroup_headroom(str(tmp_path), str(proc)) is None
    assert cgroup_headroom(str(tmp_path), str(tmp_path / "missing")) is None


@pytest.mark.slow
def test_run_with_no_flags_runs_a_model_that_fits_in_llama_cpp_and_says_nothing(model, capsys):
    code, out, err = run_cli(capsys, "run", model, "-p", PROMPT, "-n", 3, "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["prefetch"] is None and r["streaming"]["engine"] == "llama.cpp"
    assert "note" not in err


@pytest.mark.slow
def test_run_streams_a_model_larger_than_its_memory_without_prefetch_and_says_so(model, capsys):
    memory = half_the_experts(model, 512)
    args = ["run", model, "-p", PROMPT, "-n", 3, "--memory", memory, "--ctx", 512, "--json"]
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    r = json.loads(out)
    notes = [line for line in err.splitlines() if line.startswith("moepack: note:")]
    assert len(notes) == 1 and "do not fit in --memory" in notes[0], err
    assert r["prefetch"] is not None and r["generated_tokens"] == 3
    plan = r["streaming"]["memory"]
    assert plan["total"] == memory and r["prefetch"]["memory"] == plan["experts"]
    pager = r["stream"]["pager"]
    if pager_works():
        assert r["streaming"]["engine"] == "pager"
        assert pager is not None and pager["budget_bytes"] == plan["experts"]
    else:
        assert pager is None and "page-cache prefetcher" in err
    # --no-prefetch is llama.cpp's own mmap whatever the memory
    code, out, err = run_cli(capsys, *args, "--no-prefetch")
    assert code == 0 and json.loads(out)["prefetch"] is None and "note" not in err


@pytest.mark.slow
def test_streaming_llama_attaches_what_run_would_run(model):
    pytest.importorskip("llama_cpp")
    from moepack.llama import streaming_llama

    small = half_the_experts(model, 256)
    llm = streaming_llama(model, memory=small, n_ctx=256, n_threads=1, verbose=False)
    try:
        hook = llm._moepack_hook
        text = llm.create_completion(PROMPT, max_tokens=3, temperature=0)["choices"][0]["text"]
        assert isinstance(text, str) and hook.snapshot()["passes"] > 0
        assert (hook.report()["pager"] is not None) == pager_works()
    finally:
        llm.close()
    plain = streaming_llama(model, n_ctx=256, n_threads=1, verbose=False)
    try:  # it fits here: llama.cpp alone, no hook
        assert getattr(plain, "_moepack_hook", None) is None
        assert plain._moepack_streaming.engine == "llama.cpp"
    finally:
        plain.close()


def test_run_resolves_its_threads_and_engine_at_a_given_memory_available(model):
    """``resolve_run``: what run (with its tuner) and serve (without) settle before loading,
    at a memory available given rather than measured (what ``fit`` asks)."""
    from moepack.llama.runtime.run import cores, resolve_run

    n = cores()
    roomy = resolve_run(model, AutoStream(), threads=None, threads_batch=None, available=64 * GIB)
    assert (roomy.threads, roomy.tune, roomy.threads_batch) == (n, None, n)
    assert roomy.streaming.engine == "llama.cpp" and roomy.fault_threads == n
    half = half_the_experts(model)
    tight = resolve_run(
        model, AutoStream(), threads=None, threads_batch=None, memory=half, available=1 << 20
    )
    assert tight.threads == max(1, n - 1) and tight.threads_batch == n
    assert tight.tune == ((n - 1, n) if n > 1 else None) and tight.fault_threads == n
    plan = tight.streaming.plan
    assert plan is not None and plan.total == half
    assert tight.streaming.prefetch == StreamOptions(memory=plan.experts)
    served = resolve_run(
        model, AutoStream(), threads=None, threads_batch=None, memory=half, available=1 << 20,
        tune=False,
    )  # fmt: skip
    assert served.tune is None and served.threads == tight.threads
    given = resolve_run(model, AutoStream(), threads=1, threads_batch=None, available=64 * GIB)
    assert (given.threads, given.tune, given.threads_batch) == (1, None, 1)


@pytest.mark.slow
def test_serve_counts_its_prefix_cache_in_the_memory(model, capsys):
    pytest.importorskip("llama_cpp.server", reason="moepack[serve] is installed by ./dev test")
    memory = half_the_experts(model, 512)  # room for the experts' half, not a prefix cache too
    code, out, err = run_cli(capsys, "serve", model, "--port", 0, "--ctx", 512, "--memory", memory,
                             "--prefix-cache", "1G")  # fmt: skip
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "a 1.0 GiB prefix cache" in err and f"--memory is {memory:,} bytes" in err
