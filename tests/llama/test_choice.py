"""What runs a model when no flag says (``llama.runtime.choice``): llama.cpp's defaults where
the model fits, the prefetcher with the pager where it does not (one line saying so), the
flags choosing otherwise; the same choice in ``run``, ``serve`` and ``streaming_llama``; and
the memory available as a container's limit leaves it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint.synth import synth_model
from moepack.llama.prefetcher.streamer import MARGIN, StreamOptions, wants_pager
from moepack.llama.runtime.choice import AutoStream, choose_streaming, fits, pager_works
from moepack.storage.linux import cgroup_headroom

GIB = 1 << 30
PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    spec = tiny_spec(layers=3, experts=16, top_k=4, hidden=256, expert_ffn=256, weight_type="Q8_0")
    return synth_model(tmp_path_factory.mktemp("choice") / "m.gguf", spec).paths[0]


def test_a_model_that_fits_runs_llama_cpp_alone_and_one_that_does_not_streams(model):
    size = model.stat().st_size
    roomy = choose_streaming(model, AutoStream(), available=64 * GIB)
    assert roomy.prefetch is None and roomy.engine == "llama.cpp" and roomy.note is None
    tight = choose_streaming(model, AutoStream(), available=size // 2)
    assert tight.prefetch == StreamOptions()
    assert tight.engine == ("pager" if pager_works() else "page cache")
    assert tight.note is not None and "does not fit" in tight.note and "\n" not in tight.note
    # the margin counts: a file that fills what is available exactly does not fit
    assert not fits(size, size) and fits(size, size + MARGIN + size // 10)
    assert not fits(size, size + MARGIN + size // 10, reserve=size)


def test_the_flags_choose_otherwise(model):
    asked = StreamOptions(pager="off")
    on = choose_streaming(model, asked, available=64 * GIB)
    assert on.prefetch is asked and on.engine == "page cache" and on.note is None
    off = choose_streaming(model, None, available=1)
    assert off.prefetch is None and off.engine == "llama.cpp"
    # a --memory smaller than the model streams even where the model would fit
    small = StreamOptions(memory=model.stat().st_size // 2)
    budget = choose_streaming(model, AutoStream(small), available=64 * GIB)
    assert budget.prefetch is small and "larger than" in (budget.note or "")


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
    budget = model.stat().st_size // 2
    args = ["run", model, "-p", PROMPT, "-n", 3, "--memory", budget, "--json"]
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    r = json.loads(out)
    notes = [line for line in err.splitlines() if line.startswith("moepack: note:")]
    assert len(notes) == 1 and "larger than --memory" in notes[0], err
    assert r["prefetch"] is not None and r["generated_tokens"] == 3
    pager = r["stream"]["pager"]
    if pager_works():
        assert r["streaming"]["engine"] == "pager"
        assert pager is not None and pager["budget_bytes"] == budget
    else:
        assert pager is None and "page-cache prefetcher" in err
    # --no-prefetch is llama.cpp's own mmap whatever the memory
    code, out, err = run_cli(capsys, *args, "--no-prefetch")
    assert code == 0 and json.loads(out)["prefetch"] is None and "note" not in err


@pytest.mark.slow
def test_streaming_llama_attaches_what_run_would_run(model):
    pytest.importorskip("llama_cpp")
    from moepack.llama import streaming_llama

    small = StreamOptions(memory=model.stat().st_size // 2)
    llm = streaming_llama(model, prefetch=AutoStream(small), n_ctx=256, n_threads=1, verbose=False)
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
