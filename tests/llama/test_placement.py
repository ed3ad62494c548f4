"""Weight placement: Q4_K_M and Q4_0 experts stay in the file's mapping with
``experts-mapped`` (anonymous memory after load small, the dense weights still repacked, the
logits close to llama.cpp's defaults), ``run --json`` says so, and the library hook refuses a
``Llama`` whose experts llama.cpp copied out of the mapping, in one line saying how to load it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint.model import MoeModel
from moepack.checkpoint.routing import RoutingSpec
from moepack.checkpoint.synth import synth_model
from moepack.errors import BadInput
from moepack.llama import llama_placement, prefetching, streaming_llama
from moepack.llama.prefetcher.pinning import dense_tensors
from moepack.llama.prefetcher.prefetch import merge_ranges
from moepack.llama.runtime import ggml_backend
from moepack.llama.runtime.memory_plan import memory_for_experts
from moepack.llama.runtime.placement import (
    _patterns,
    choose,
    nothing_to_stream,
    plan_placement,
    prefetch_unless_idle,
)
from moepack.llama.runtime.run import RunOptions, run_model
from moepack.llama.runtime.weights import WeightReport, WeightSite

PROMPT = "the quick brown fox jumps over"
TYPES = ("Q4_K_M", "Q4_0")
ROUTING = "cluster=4,stay=0.8,coupling=0.95,skew=1"


def test_auto_keeps_experts_mapped_when_streaming_or_when_the_model_does_not_fit():
    assert choose(1 << 30, streaming=True, available=64 << 30)[0] == "experts-mapped"
    assert choose(1 << 30, streaming=False, available=1 << 30)[0] == "experts-mapped"
    assert choose(1 << 30, streaming=False, available=2 << 30)[0] == "defaults"


def test_override_patterns_match_exactly_the_tensors_named():
    import re

    names = ("blk.0.attn_q.weight", "blk.12.attn_q.weight", "output.weight", "blk.3.ffn_up.weight")
    pats = [re.compile(p) for p in _patterns(names)]
    assert len(pats) == 3
    hit = {n for n in names if any(p.search(n) for p in pats)}
    assert hit == set(names)
    for other in ("blk.1.attn_q.weight", "blk.120.attn_q.weight", "blk.0.attn_q_norm.weight",
                  "blk.3.ffn_up_exps.weight", "output_norm.weight"):  # fmt: skip
        assert not any(p.search(other) for p in pats), other


def test_a_placement_that_does_not_exist_is_refused(tmp_path):
    with pytest.raises(BadInput, match="placement"):
        plan_placement(tmp_path / "m.gguf", "everywhere", streaming=False)
    with pytest.raises(BadInput, match="placement"):
        RunOptions(placement="everywhere").validate()


def test_weights_in_any_extra_buffer_type_count_as_repacked():
    # a build for a CPU with AMX puts the 2-D matrices of the types it has kernels for in its
    # own buffer type (out of the mapping, in its tile layout), and the experts in CPU_REPACK
    sites = {
        "blk.0.attn_q.weight": WeightSite("AMX", False),
        "blk.0.ffn_up_exps.weight": WeightSite("CPU_REPACK", False),
        "blk.0.ffn_down_exps.weight": WeightSite("CPU_Mapped", True),
        "output.weight": WeightSite("AMX", False),
    }
    experts = frozenset({"blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight"})
    report = WeightReport({"placement": "defaults"}, sites, experts, None).to_json()
    assert report["repacked"] == [
        "blk.0.attn_q.weight",
        "blk.0.ffn_up_exps.weight",
        "output.weight",
    ]
    assert report["repacked_experts"] == ["blk.0.ffn_up_exps.weight"]
    assert report["buffer_types"] == {"AMX": 2, "CPU_Mapped": 1, "CPU_REPACK": 1}
    assert report["experts_unmapped"] == ["blk.0.ffn_up_exps.weight"]


@pytest.fixture(scope="module", params=TYPES)
def quantised(request, tmp_path_factory) -> Path:
    # planted routing: a random router's near-ties flip under the repacked kernels' other
    # summation order, and one flipped expert moves the logits more than the kernels do
    spec = tiny_spec(layers=2, experts=16, top_k=4, hidden=256, expert_ffn=256,
                     vocab=320, weight_type=request.param, routing=RoutingSpec.parse(ROUTING))  # fmt: skip
    return synth_model(tmp_path_factory.mktemp("q") / f"{request.param}.gguf", spec).paths[0]


def _expert_bytes(path: Path) -> int:
    with MoeModel(path) as m:
        return m.expert_bytes


@pytest.mark.slow
def test_experts_mapped_keeps_the_experts_in_the_mapping_and_the_dense_repacked(
    quantised, tmp_path
):
    pytest.importorskip("llama_cpp")
    runs, logits = {}, {}
    for placement in ("defaults", "experts-mapped", "mapped"):
        out = tmp_path / f"{placement}.npy"
        options = RunOptions(n_predict=6, threads=1, n_ctx=256, placement=placement)
        runs[placement] = run_model(quantised, PROMPT, options, logits_out=out).weights
        logits[placement] = np.load(out)
    stock, kept, plain = runs["defaults"], runs["experts-mapped"], runs["mapped"]
    assert stock is not None and kept is not None and plain is not None
    experts = _expert_bytes(quantised)
    # llama.cpp's defaults copy the experts out of the mapping into anonymous memory
    assert stock["repacked_experts"] and not stock["experts_mapped"]
    assert stock["anon_bytes_of_load"] > experts // 2
    # experts-mapped: every expert in the mapping, the dense matrices repacked as by default
    # (into CPU_REPACK by name; where the build has AMX, the defaults take them into AMX's
    # buffer first, and more of them: Q8_0 and Q6_K too)
    assert kept["experts_mapped"] and not kept["repacked_experts"]
    dense_stock = sorted(set(stock["repacked"]) - set(stock["repacked_experts"]))
    assert set(kept["buffer_types"]) <= {"CPU_REPACK", "CPU_Mapped", "CPU"}
    if "AMX" in stock["buffer_types"]:
        assert kept["repacked"] and set(kept["repacked"]) <= set(dense_stock)
    else:
        assert kept["repacked"] == dense_stock and dense_stock
    assert kept["anon_bytes_of_load"] < experts // 8
    assert plain["experts_mapped"] and plain["repacked"] == []
    # the repacked kernels sum in another order: close (7e-7 here, 0.016 on bench_placement.py's)
    assert np.abs(logits["experts-mapped"] - logits["defaults"]).max() < 0.05
    assert np.abs(logits["mapped"] - logits["defaults"]).max() < 0.05


def _repacking_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """An x86 CPU with AVX2 and llama.cpp's repack buffer type, without loading ggml into this
    process (its library starts a thread that would take the signals later tests send us)."""
    monkeypatch.setattr(ggml_backend, "cpu_features", lambda: frozenset({"AVX2", "REPACK"}))
    monkeypatch.setattr(ggml_backend, "cpu_extra_bufts", lambda: {ggml_backend.REPACK_BUFT: 0})


def test_a_repacked_model_that_fits_is_not_streamed_unless_a_smaller_budget_asks(
    quantised, tmp_path, monkeypatch
):
    _repacking_cpu(monkeypatch)
    size = quantised.stat().st_size
    why = nothing_to_stream(quantised, available=64 * size)
    assert why is not None and "fits" in why and "\n" not in why
    assert nothing_to_stream(quantised, available=size) is None  # no room to repack
    assert nothing_to_stream(quantised, size // 2, available=64 * size) is None  # a budget
    assert nothing_to_stream(quantised, 2 * size, available=64 * size) is not None
    plain = tiny_spec(layers=2, experts=16, top_k=4, hidden=256, expert_ffn=256, vocab=320)
    q8 = synth_model(tmp_path / "q8.gguf", plain).paths[0]
    assert nothing_to_stream(q8, available=64 * size) is None  # Q8_0 is never repacked
    said: list[str] = []
    on = {"pager": "on", "memory": "auto"}
    assert prefetch_unless_idle(quantised, "auto", on, said.append) is on
    assert prefetch_unless_idle(quantised, "experts-mapped", {}, said.append) == {}
    assert said == []
    monkeypatch.setattr(ggml_backend, "cpu_extra_bufts", lambda: {})  # no repacking here
    assert nothing_to_stream(quantised, available=64 * size) is None


def _streams_nothing_here(model: Path) -> bool:
    """``nothing_to_stream`` on this machine's CPU, asked in a process of its own."""
    code = (
        "import sys; from moepack.llama.runtime.placement import nothing_to_stream; "
        "print(nothing_to_stream(sys.argv[1]) is not None)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return out.strip() == "True"


@pytest.mark.slow
def test_run_json_says_where_the_weights_are(quantised, capsys):
    pytest.importorskip("llama_cpp")
    with MoeModel(quantised) as m:  # half the experts
        half = memory_for_experts(quantised, m.expert_bytes // 2, n_ctx=256)
    code, out, _err = run_cli(capsys, "run", quantised, "-p", PROMPT, "-n", "2", "--threads", "1",
                              "--ctx", "256", "--prefetch", "--memory", half, "--json")  # fmt: skip
    assert code == 0
    weights = json.loads(out)["weights"]
    assert weights["placement"] == "experts-mapped" and weights["experts_mapped"]
    assert weights["reason"].startswith("the prefetcher streams")
    assert weights["anon_bytes_after_load"] > 0 and weights["weights_seen"] > 0


@pytest.mark.slow
def test_prefetch_on_a_repacked_model_that_fits_runs_llama_cpp_defaults_and_says_so(
    quantised, capsys
):
    pytest.importorskip("llama_cpp")
    if not _streams_nothing_here(quantised):
        pytest.skip("llama.cpp repacks nothing on this CPU, or the machine has no room")
    code, out, err = run_cli(capsys, "run", quantised, "-p", PROMPT, "-n", "2", "--threads", "1",
                             "--ctx", "256", "--prefetch", "--json")  # fmt: skip
    assert code == 0
    result = json.loads(out)
    assert result["weights"]["placement"] == "defaults" and result["weights"]["repacked_experts"]
    assert result["stream"] is None
    lines = [line for line in err.splitlines() if "stays off" in line]
    assert len(lines) == 1 and lines[0].startswith("moepack: warning:")


@pytest.mark.slow
def test_the_hook_refuses_a_llama_whose_experts_were_repacked_and_says_how(quantised):
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(quantised), n_ctx=256, n_threads=1, verbose=False)
    try:
        with pytest.raises(BadInput) as e:
            prefetching(llm)
        message = str(e.value)
        assert "\n" not in message and "streaming_llama" in message and str(quantised) in message
        assert getattr(llm, "_moepack_hook", None) is None
    finally:
        llm.close()
    original = llama_cpp.llama_cpp.llama_model_default_params
    with llama_placement(quantised) as plan:
        assert plan.name == "experts-mapped"
        inside = llama_cpp.Llama(str(quantised), n_ctx=256, n_threads=1, verbose=False)
    assert llama_cpp.llama_cpp.llama_model_default_params is original
    inside.close()
    llm = streaming_llama(
        quantised, "experts-mapped", prefetch=None, n_ctx=256, n_threads=1, verbose=False
    )
    try:
        assert getattr(llm, "_moepack_hook", None) is None  # asked for none: yours to attach
        hook = prefetching(llm)
        text = llm.create_completion(PROMPT, max_tokens=3, temperature=0)["choices"][0]["text"]
        assert isinstance(text, str) and hook.snapshot()["passes"] > 0
        hook.detach()
    finally:
        llm.close()


@pytest.mark.slow
def test_dense_weights_llama_cpp_repacked_are_not_locked_a_second_time(quantised, capsys):
    pytest.importorskip("llama_cpp")
    code, out, err = run_cli(capsys, "run", quantised, "-p", PROMPT, "-n", 2, "-t", 1,
                             "--ctx", 256, "--prefetch", "--pin-dense", "on",
                             "--placement", "experts-mapped", "--json")  # fmt: skip
    assert code == 0, err
    r = json.loads(out)
    copied = set(r["weights"]["repacked"])
    with MoeModel(quantised) as m:
        dense = dense_tensors(m)
    # the repacked copies live in llama.cpp's memory: only what it reads from the file is locked
    assert copied and copied <= set(dense)
    left = merge_ranges([rng for name, rng in dense.items() if name not in copied])
    # the ranges are whole pages and the lock stops at the end of the file: where the file's
    # last tensor is one llama.cpp reads from it (Q4_K_M), its last page runs past the end
    size = quantised.stat().st_size
    assert r["stream"]["pinned_bytes"] == sum(min(rng.end, size) - rng.offset for rng in left)
    assert r["stream"]["pinned_bytes"] < sum(
        rng.length for rng in merge_ranges(list(dense.values()))
    )
