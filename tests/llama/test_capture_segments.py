"""A real capture of two prompts through ``moepack trace capture`` records each prompt's
prefill and decode as the trace's segments, and the statistics count every prompt's decode."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint.synth import synth_model
from moepack.trace import load_trace
from moepack.trace.stats import expert_counts

pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("capseg")
    return synth_model(d / "m.gguf", tiny_spec(layers=2, experts=8, top_k=2, seed=3)).paths[0]


def test_two_prompt_capture_has_both_prompts_decode(model, tmp_path, capsys):
    pf = tmp_path / "p.jsonl"
    pf.write_text('{"prompt": "the first prompt is a little longer"}\n{"prompt": "second"}\n')
    out = tmp_path / "t.moetrace"
    code, stdout, err = run_cli(
        capsys, "trace", "capture", model, "--out", out, "--prompt-file", pf, "-n", 5, "--json"
    )
    assert code == 0, err
    result = json.loads(stdout)
    t = load_trace(out)
    recorded = t.provenance["capture"]["prompts"]
    assert [(s.start, s.prefill, s.decode) for s in t.prompt_segments] == [
        (s["start"], s["prefill"], s["decode"]) for s in recorded
    ]
    assert t.prompts == 2 and all(s["decode"] == 5 for s in recorded)
    assert t.decode_tokens == 10 == result["decode_tokens"]
    assert t.prefill_tokens == sum(s["prefill"] for s in recorded) == result["prefill_tokens"]
    second = recorded[1]
    mask = t.phase_mask("decode")
    assert not mask[second["start"] : second["start"] + second["prefill"]].any()
    assert mask[second["start"] + second["prefill"] :].all()
    ids = np.asarray(t.ids)
    manual = np.stack([np.bincount(ids[mask, la].ravel(), minlength=8) for la in range(2)])
    np.testing.assert_array_equal(expert_counts(t, "decode"), manual)

    code, stdout, err = run_cli(capsys, "trace", "stats", out, "--json")
    assert code == 0, err
    assert json.loads(stdout)["phases"]["decode"]["tokens"] == 10
    code, stdout, err = run_cli(capsys, "trace", "info", out, "--json")
    assert code == 0, err
    info = json.loads(stdout)
    assert info["decode_tokens"] == 10 and info["phases"]["decode"]["tokens"] == 10
