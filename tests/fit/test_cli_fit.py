"""``moepack fit`` end to end: it estimates what ``run`` does with no flags, and what it says
run will choose (the engine, the memory plan, the budget, the threads) is what run's own
``--json`` reports for the same memory; where run would refuse, fit says so in run's words;
a local model and the same split set over HTTP give the same estimate and the same choice;
a trace narrows the hit rates to one value; --verify runs the model as run would and
compares; bad inputs are one line with exit 2. The calibration runs in llama.cpp once per
module (into a temporary cache directory); the storage is measured tiny once and cached
there too."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.synth import synth_model
from moepack.cli.flags import reword
from moepack.fit.command import fit_model
from moepack.fit.device import storage_profile
from moepack.llama.prefetcher.pager import minimum_budget
from moepack.llama.prefetcher.pinning import dense_ranges
from moepack.llama.prefetcher.prefetch import ExpertRanges
from moepack.llama.prefetcher.streamer import MARGIN
from moepack.llama.runtime.choice import AutoStream, pager_works
from moepack.llama.runtime.memory_plan import RUNTIME_BYTES, context_needs, memory_for_experts
from moepack.llama.runtime.run import cores, resolve_run
from moepack.trace import synth_trace
from moepack.trace.formats import save_trace
from rangeserver import serving

pytestmark = pytest.mark.slow

TINY = dict(sizes=[64 << 10, 256 << 10], depths=[1, 8], cell_seconds=0.02, repeats=1,
            fault_slices=4)  # fmt: skip
PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder with a model, its split twin and a trace; the cache directory set
    for the module, the storage measured into it (tiny) for the model's device."""
    d = tmp_path_factory.mktemp("fit")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOEPACK_CACHE_DIR", str(d / "cache"))
        spec = tiny_spec(layers=3, experts=16, top_k=4, hidden=256, expert_ffn=256)
        synth_model(d / "m.gguf", spec)
        synth_model(d / "split.gguf", spec, split_max_size=14_000_000)
        with MoeModel(d / "m.gguf") as m:
            save_trace(synth_trace(m, tokens=200, prefill_tokens=50, seed=5), d / "t.moetrace")
        storage_profile(d / "m.gguf", **TINY)  # type: ignore[arg-type]
        (d / "cache" / "fit" / "probe").mkdir(parents=True)
        storage_profile(d / "cache" / "fit" / "probe", **TINY, corpus_bytes=4 << 20)  # type: ignore[arg-type]
        yield d


def _half(model: Path, n_ctx: int = 4096) -> int:
    """A --memory holding the run and its context but half the routed experts."""
    with MoeModel(model) as m:
        return memory_for_experts(model, m.expert_bytes // 2, n_ctx=n_ctx)


def _fit(capsys: pytest.CaptureFixture[str], *args: object) -> dict[str, Any]:
    code, out, err = run_cli(capsys, "fit", *args, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert isinstance(doc, dict)
    return doc


def _run(capsys: pytest.CaptureFixture[str], *args: object) -> dict[str, Any]:
    code, out, err = run_cli(capsys, "run", *args, "-p", PROMPT, "-n", 2, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert isinstance(doc, dict)
    return doc


def test_a_model_that_fits_runs_llama_cpp_s_defaults(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _fit(capsys, home / "m.gguf", "-t", "1")
    assert doc["fits"] is True and doc["verdict"] == "fits" and doc["refusal"] is None
    run = doc["run"]
    assert run["engine"] == "llama.cpp" and run["threads"] == 1 and run["threads_batch"] == 1
    assert "llama.cpp's defaults" in run["summary"]
    main = doc["points"][0]
    for role in ("run", "serve", "stock"):
        e = main[role]
        assert e["decode_tps"]["low"] > 0 and e["prefill_tps"]["low"] > 0
        assert e["limiter"] == "CPU" and e["threads"] == 1
    assert doc["hit_source"] == "priors" and "PR #27861" in str(doc["hit_prior_source"])
    cal = doc["calibration"]
    assert isinstance(cal, dict) and {t["threads"] for t in cal["times"]} >= {1}
    assert {"knee", "fit_memory", "min_memory", "shape", "storage", "machine"} <= set(doc)
    assert doc["overlap"]["source"]  # the overlap shares say where they come from
    # what run with no flags reports for the same machine: llama.cpp alone
    r = _run(capsys, home / "m.gguf", "-t", "1")
    assert r["streaming"]["engine"] == run["engine"] and r["prefetch"] is None
    assert r["threads"] == run["threads"] and r["threads_batch"] == run["threads_batch"]


def test_what_fit_says_run_chooses_is_what_run_chooses(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model that does not fit in --memory: fit names the engine, the memory plan and the
    budget, and run --json with the same --memory reports the same in its streaming section."""
    model = home / "m.gguf"
    memory = _half(model)
    doc = _fit(capsys, model, "--memory", memory)
    run = doc["run"]
    assert doc["fits"] is False and doc["verdict"] in ("streams", "too slow")
    assert run["engine"] == ("pager" if pager_works() else "page cache")
    assert run["engine"] in run["summary"] and "budget" in run["summary"]
    r = _run(capsys, model, "--memory", memory)
    streaming = r["streaming"]
    assert streaming["engine"] == run["engine"]
    assert streaming["memory"] == run["memory"]  # run's own plan, term by term
    assert r["prefetch"]["memory"] == run["budget_bytes"] == run["memory"]["experts"]
    assert r["threads"] == run["threads"] and r["threads_batch"] == run["threads_batch"]
    tuning = r["thread_tuning"]
    assert (tuning["choices"] if tuning else None) == run["thread_choices"]
    cache = r["stream"]["cache"]
    assert cache["budget_bytes"] == run["cache_bytes"]
    assert min(cache["slots_per_layer"]) == run["slots_per_layer"]
    if run["engine"] == "pager":
        assert r["stream"]["pager"]["budget_bytes"] == run["budget_bytes"]
    main = doc["points"][0]
    assert main["run"]["runner"] == run["engine"] and main["stock"]["runner"] == "mmap"
    assert main["run"]["read_per_token"]["high"] > 0
    # the decode threads run's tuner is expected to settle on, and the line says them
    assert run["decode_threads_chosen"] == main["run"]["threads"]
    chosen = run["decode_threads_chosen"]
    if isinstance(chosen, int):
        assert f"decode at {chosen} thread" in run["summary"]
    # the table says it in words
    code, out, err = run_cli(capsys, "fit", model, "--memory", memory, "-q")
    assert code == 0, err
    for word in ("does not fit", "verdict", "run with no flags", run["engine"], "knee"):
        assert word in out, out


def test_no_flags_where_the_model_does_not_fit_is_what_run_and_serve_choose(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fit MODEL`` with no flags on a machine whose memory available does not hold the
    model (given here; ``fit`` measures it otherwise): the engine run's own code chooses with
    its budget, the decode threads and the tuner's counts, prompts at run's batch threads
    (every core); serve as serve chooses, its default prefix cache counted in the memory —
    here that leaves its experts too little, and fit says so in serve's own words."""
    model = home / "m.gguf"
    half = _half(model)
    available = half + MARGIN  # run's auto memory: the available less the margin
    settings = resolve_run(model, AutoStream(), threads=None, threads_batch=None,
                           available=available)  # fmt: skip
    assert settings.streaming.prefetch is not None  # run streams here
    r = fit_model(str(model), available=available)
    run, main = r.main.choice, r.main
    assert run.engine == settings.streaming.engine == ("pager" if pager_works() else "page cache")
    assert run.plan == settings.streaming.plan and run.plan.total == half and not run.plan.asked
    assert run.budget == settings.streaming.prefetch.memory == run.plan.experts > 0
    assert (run.threads, run.tune) == (settings.threads, settings.tune)
    assert run.threads_batch == settings.threads_batch == cores()  # prompts at every core
    assert main.run.runner == run.engine and main.run.threads_batch == cores()
    assert main.verdict in ("streams", "too slow") and main.run.prefill_tps[0] > 0
    doc = r.to_json()
    line = doc["run"]["summary"]
    assert doc["run"]["budget_bytes"] == run.budget and f"prompts at {cores()}" in line
    assert line.startswith(f"{run.engine}, budget ")
    # serve keeps a 2 GiB prefix cache by default: in this memory it would refuse
    served = main.served
    assert served.engine == "refused" and served.plan.prefix_cache == 2 << 30
    assert main.serve.runner == "refused" and doc["serve"]["refusal"] == served.refusal
    assert "prefix cache" in str(served.refusal)
    code, out, err = run_cli(capsys, "serve", model, "--port", 0, "--memory", half)
    assert code == 2 and out == "", err
    assert reword(str(served.refusal)).replace("the memory available", "--memory") in err


def test_fit_takes_run_s_batch_and_prompt_threads(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--batch`` and ``--threads-batch`` as run takes them: the memory plan counts the
    compute buffers at that batch, prompts run at those threads; run --json agrees."""
    model = home / "m.gguf"
    memory = _half(model)
    flags = ("--memory", memory, "--batch", 64, "--threads-batch", 1)
    doc = _fit(capsys, model, *flags)
    run = doc["run"]
    assert doc["batch"] == 64 and run["threads_batch"] == 1
    assert doc["points"][0]["run"]["threads_batch"] == 1
    r = _run(capsys, model, *flags)
    assert r["streaming"]["memory"] == run["memory"] and r["threads_batch"] == 1
    default = _fit(capsys, model, "--memory", memory)["run"]["memory"]["context"]
    assert run["memory"]["context"]["compute_bytes"] < default["compute_bytes"]


def test_fit_refuses_where_run_refuses_in_run_s_words(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = home / "m.gguf"
    (need,) = context_needs(model, [512])
    with MoeModel(model) as m:
        least = minimum_budget(ExpertRanges(m), cores())
        dense = sum(r.length for r in dense_ranges(m))
    # room for the experts' least and a 512-token context, not for 4096 tokens
    memory = dense + RUNTIME_BYTES + least + need.bytes + 1024
    code, out, err = run_cli(capsys, "run", model, "-p", PROMPT, "-n", 1, "--memory", memory)
    assert code == 2 and out == ""
    refused = err.strip().splitlines()
    assert len(refused) == 1 and "`" not in refused[0] and "--ctx" in refused[0]
    code, out, err = run_cli(capsys, "fit", model, "--memory", memory, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["verdict"] == "refused" and doc["run"]["engine"] == "refused"
    warned = [line for line in err.splitlines() if line.startswith("moepack: warning:")]
    assert len(warned) == 1 and "run would refuse" in warned[0]
    # the same words as run's own refusal (after its "moepack: error: FILE: ")
    assert refused[0].split(": ", 3)[3] in warned[0]
    assert doc["points"][0]["stock"]["runner"] == "mmap"  # llama.cpp's own, beside it
    v = _fit(capsys, model, "--memory", memory, "--verify")["verify"]  # nothing to run
    assert v["verdict"] == "refused" and v["runs"] == [] and v["figures"] == []
    fits = int(refused[0].rsplit("--ctx ", 1)[1].split()[0])
    doc = _fit(capsys, model, "--memory", memory, "--ctx", fits)
    assert doc["verdict"] != "refused" and doc["refusal"] is None


def test_url_matches_local(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shards = sorted(home.glob("split-*-of-*.gguf"))
    assert len(shards) >= 2
    memory = _half(shards[0])
    local = _fit(capsys, shards[0], "--memory", memory, "-t", "1")
    with serving(home) as srv:
        remote = _fit(capsys, f"{srv.url}/{shards[-1].name}", "--memory", memory, "-t", "1")
    assert remote["remote"]["bytes_read"] < remote["remote"]["total_bytes"] / 10
    assert len(remote["remote"]["shards"]) == len(shards)
    assert remote["shape"] == local["shape"]
    assert remote["calibration"]["key"] == local["calibration"]["key"]
    # run's own plan on the header alone: the same choice as on the file
    assert remote["run"]["engine"] == local["run"]["engine"] != "refused"
    assert remote["run"]["memory"] == local["run"]["memory"]
    assert remote["run"]["budget_bytes"] == local["run"]["budget_bytes"]


def test_trace_narrows_hits(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = home / "m.gguf"
    doc = _fit(capsys, model, "--memory", _half(model), "-t", "1", "--trace", home / "t.moetrace")
    assert doc["hit_source"] == "trace"
    for p in doc["points"]:
        hit = p["run"]["hit_rate"]
        if hit is not None:
            assert hit["low"] == hit["high"]


def test_verify_runs_what_run_runs(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = home / "m.gguf"
    doc = _fit(capsys, model, "--memory", _half(model), "-t", "1", "--verify")
    v = doc["verify"]
    assert isinstance(v, dict)
    assert [f["figure"] for f in v["figures"]] == ["run decode", "run prefill"]
    assert all(f["measured"] > 0 for f in v["figures"])
    assert len(v["runs"]) == 1 and v["runs"][0]["engine"] == doc["run"]["engine"]
    assert v["choice"]["same"] is True, v["choice"]
    assert v["verdict"] in ("streams", "too slow")


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["missing.gguf"], "missing.gguf"),
        (["t.moetrace"], "not a GGUF"),
        (["m.gguf", "--trace", "m.gguf"], "m.gguf"),
        (["http://127.0.0.1:9/m.gguf", "--verify"], "give a local file"),
        (["m.gguf", "--memory", "lots"], "not a size"),
    ],
)
def test_bad_inputs(
    home: Path, capsys: pytest.CaptureFixture[str], args: list[str], problem: str
) -> None:
    here = Path.cwd()
    os.chdir(home)
    try:
        code, out, err = run_cli(capsys, "fit", *args, "-q")
    finally:
        os.chdir(here)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and problem in lines[0], err


def test_trace_of_another_shape(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "o.moetrace"
    save_trace(synth_trace(layers=5, n_expert=8, top_k=2, tokens=20), other)
    code, out, err = run_cli(capsys, "fit", home / "m.gguf", "--trace", other, "-q")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert str(other) in err
