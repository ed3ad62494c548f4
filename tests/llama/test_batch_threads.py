"""Prompts run at every core (``run.batch_threads``): passes of more than one token take
``--threads-batch``, else ``--threads`` when given, else every core, whatever a single-token
pass runs at; the logits are the same bits at any count."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint.synth import synth_model
from moepack.llama.runtime.run import RunOptions, batch_threads, cores, run_model

PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 6)


def test_prompts_take_every_core_unless_told():
    assert batch_threads(None, None) == cores() == len(os.sched_getaffinity(0))
    assert batch_threads(1, None) == 1  # --threads given: the same for prompts
    assert batch_threads(1, 2) == 2 and batch_threads(None, 3) == 3


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    spec = tiny_spec(layers=3, experts=16, top_k=4, hidden=256, expert_ffn=256, weight_type="Q8_0")
    return synth_model(tmp_path_factory.mktemp("batch") / "m.gguf", spec).paths[0]


@pytest.mark.slow
def test_run_reports_the_prompt_threads_and_the_logits_do_not_change(model, tmp_path, capsys):
    code, out, err = run_cli(capsys, "run", model, "-p", PROMPT, "-n", 4, "-t", 1, "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["threads"] == 1 and r["threads_batch"] == 1
    code, out, err = run_cli(
        capsys, "run", model, "-p", PROMPT, "-n", 4, "-t", 1, "--threads-batch", 2, "--json"
    )
    assert code == 0, err
    r = json.loads(out)
    assert r["threads"] == 1 and r["threads_batch"] == 2
    logits = []
    for tb in (1, 2):
        out_path = tmp_path / f"l{tb}.npy"
        opts = RunOptions(n_predict=4, threads=1, threads_batch=tb, n_ctx=1024, prefetch=None)
        run_model(model, PROMPT, opts, logits_out=out_path)
        logits.append(np.load(out_path))
    assert np.array_equal(logits[0], logits[1])  # the prompt's logits included


@pytest.mark.slow
def test_batch_sets_the_prompt_tokens_per_pass(model, capsys):
    for batch in (64, 512):
        code, out, err = run_cli(capsys, "run", model, "-p", PROMPT, "-n", 1, "-t", 1,
                                 "--ctx", 1024, "--batch", batch, "--prefetch", "--json")  # fmt: skip
        assert code == 0, err
        r = json.loads(out)
        passes = r["prefill"]["prefetch"]["passes"]
        assert passes == -(-r["prompt_tokens"] // batch), (batch, passes, r["prompt_tokens"])
