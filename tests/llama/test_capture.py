"""``trace capture`` records what llama.cpp's router really chose, on every token."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moefixtures import craft_metadata, metadata_entries, run_cli, tiny_spec, write_gguf
from moepack.checkpoint import MoeModel
from moepack.checkpoint.provenance import read_provenance
from moepack.checkpoint.synth import synth_model
from moepack.errors import BadInput
from moepack.layout.plan import LayerPlan, Plan
from moepack.llama.runtime.capture import (
    PHASE_DECODE,
    PHASE_PREFILL,
    CaptureOptions,
    capture_trace,
    token_phases,
    token_prompts,
)
from moepack.llama.runtime.prompts import Prompt, read_prompt_file
from moepack.rewrite.repack import repack
from moepack.trace import load_trace
from numpy_qwen3moe import Qwen3MoeReference

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
pytestmark = pytest.mark.slow

PROMPTS = [
    "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun.",
    "Mixture of experts",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("capture")
    return synth_model(d / "m.gguf", tiny_spec(layers=3, experts=8, top_k=3, seed=5)).paths[0]


def _capture(model: Path, out: Path, n_predict: int = 4, **kw: int) -> Path:
    options = CaptureOptions(n_predict=n_predict, **kw)  # type: ignore[arg-type]
    capture_trace(model, out, [Prompt(text=p) for p in PROMPTS], options)
    return out


def _tokenize(model: Path, text: str) -> list[int]:
    vocab = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    return list(vocab.tokenize(text.encode(), add_bos=True, special=True))


@pytest.mark.parametrize("gate", ["c-gate", "python"])
def test_numpy_forward_pass_predicts_every_token(model, tmp_path, monkeypatch, gate):
    """Prefill in micro-batches of 5 and greedy decode: an independent float64 forward pass
    picks the same experts, in the same router order, on 100 % of (token, layer) — with the
    reads made by the C gate, and by Python."""
    if gate == "python":
        monkeypatch.setenv("MOEPACK_NO_C_GATE", "1")
    trace = load_trace(_capture(model, tmp_path / "t.moetrace", n_batch=8, n_ubatch=5))
    ref = Qwen3MoeReference(model)
    segments = trace.provenance["capture"]["prompts"]
    assert [s["prompt"] for s in segments] == [0, 1, 2]
    checked = 0
    for s, text in zip(segments, PROMPTS, strict=True):
        prompt = _tokenize(model, text)
        assert s["prefill"] == len(prompt) and s["decode"] == 4
        tokens, expected = ref.generate(prompt, s["decode"])
        got = np.asarray(trace.ids[s["start"] : s["start"] + len(tokens)])
        np.testing.assert_array_equal(got, expected)
        checked += len(tokens)
    assert checked == trace.tokens
    w = np.asarray(trace.weights)
    np.testing.assert_allclose(w.sum(axis=2), 1.0, rtol=1e-5)  # qwen3moe normalises top-k
    assert np.all(np.diff(w, axis=2) <= 0)  # router order: weights descend
    assert trace.model_fingerprint == MoeModel(model).fingerprint
    assert trace.block_map == [0, 1, 2]
    prompts, phases = token_prompts(trace), token_phases(trace)
    first = segments[1]
    assert prompts[first["start"]] == 1
    assert phases[first["start"]] == PHASE_PREFILL
    assert phases[first["start"] + first["prefill"]] == PHASE_DECODE


def test_threads_and_micro_batches_do_not_change_the_trace(model, tmp_path):
    a = load_trace(_capture(model, tmp_path / "a.moetrace", threads=1))
    b = load_trace(_capture(model, tmp_path / "b.moetrace", threads=2, n_batch=7, n_ubatch=3))
    np.testing.assert_array_equal(np.asarray(a.ids), np.asarray(b.ids))
    # the router weights are summed in other orders at other batch shapes (1.05e-5 apart at
    # most in a build for AVX-512, whose kernels take 16 floats at a time)
    np.testing.assert_allclose(np.asarray(a.weights), np.asarray(b.weights), rtol=1e-4)
    assert a.provenance["capture"]["prompts"] == b.provenance["capture"]["prompts"]


def test_repacked_model_maps_back_through_its_permutation(model, tmp_path):
    m = MoeModel(model)
    rng = np.random.default_rng(11)
    plan = Plan([LayerPlan(b.index, rng.permutation(b.n_expert)) for b in m.blocks], m.fingerprint)
    cand = repack(model, plan, tmp_path / "r.gguf").outputs[0]
    a = load_trace(_capture(model, tmp_path / "a.moetrace"))
    b = load_trace(_capture(cand, tmp_path / "b.moetrace"))
    prov = read_provenance(MoeModel(cand))
    assert prov is not None
    mapped = np.empty_like(np.asarray(b.ids))
    for layer, block in enumerate(b.block_map or []):
        mapped[:, layer] = prov.perm(block, 8)[np.asarray(b.ids[:, layer])]
    assert b.model_fingerprint != a.model_fingerprint
    np.testing.assert_array_equal(mapped, np.asarray(a.ids))  # same experts, same order


def test_mblt_output_keeps_the_ids(model, tmp_path):
    a = load_trace(_capture(model, tmp_path / "a.moetrace"))
    b = load_trace(_capture(model, tmp_path / "a.mblt"))
    np.testing.assert_array_equal(np.asarray(a.ids), np.asarray(b.ids))
    assert b.block_map == a.block_map and not b.has_weights


def test_cli_capture_json(model, tmp_path, capsys):
    pf = tmp_path / "p.jsonl"
    pf.write_text('{"prompt": "hello"}\n\n{"prompt": "world wide"}\n')
    out = tmp_path / "t.moetrace"
    args = ["--prompt-file", pf, "-n", 2, "--temp", 0.8, "--seed", 3, "--json", "-q"]
    code, stdout, err = run_cli(capsys, "trace", "capture", model, "--out", out, *args)
    assert code == 0, err
    assert '"tokens"' in stdout and '"truncated": false' in stdout
    t = load_trace(out)
    assert t.provenance["capture"]["sampling"] == {"temp": 0.8, "top_p": 1.0, "seed": 3}
    assert len(t.provenance["capture"]["prompts"]) == 2


def _refused(capsys, *args: object) -> str:
    code, _, err = run_cli(capsys, "trace", "capture", *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moepack: error:"), err
    return lines[0]


def test_bad_input_is_one_line_and_writes_nothing(model, tmp_path, capsys):
    out = tmp_path / "t.moetrace"
    dense = write_gguf(
        tmp_path / "dense.gguf",
        "llama",
        {"blk.0.ffn_up.weight": (64, 32), "blk.0.ffn_down.weight": (32, 64)},
    )
    assert "dense model" in _refused(capsys, dense, "-o", out, "-p", "hi")
    assert "empty" in _refused(capsys, model, "-o", out, "-p", "   ")
    assert "overwrite the input" in _refused(capsys, model, "-o", model, "-p", "hi")
    long = " ".join(["word"] * 400)
    assert "longer than the context" in _refused(capsys, model, "-o", out, "-p", long, "--ctx", 64)
    longer = " ".join(["word"] * 700)  # the model's own context (512) is the limit
    assert "context of 512" in _refused(capsys, model, "-o", out, "-p", longer)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    assert "line 2" in _refused(capsys, model, "-o", out, "--prompt-file", bad)
    assert "chat template" in _refused(capsys, model, "-o", out, "-p", "hi", "--chat")
    # llama.cpp refuses it: a MoE block whose attention tensors are missing
    broken = write_gguf(
        tmp_path / "broken.gguf",
        "qwen3moe",
        {
            "blk.0.ffn_gate_inp.weight": (4, 32),
            "blk.0.ffn_up_exps.weight": (4, 32, 32),
            "blk.0.ffn_gate_exps.weight": (4, 32, 32),
            "blk.0.ffn_down_exps.weight": (4, 32, 32),
        },
        {"qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2},
    )
    assert "llama.cpp" in _refused(capsys, broken, "-o", out, "-p", "hi")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "broken.gguf", "dense.gguf"]


# a shell's background job starts with SIGINT ignored, and Python then keeps it ignored
_CLI_WITH_CTRL_C = (
    "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from moepack.cli.main import main; main()"
)


def _only_child(pid: int) -> int | None:
    """The one child of ``pid`` (the capture worker), or None once it has gone."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except FileNotFoundError:
        return None
    return int(children[0]) if children else None


def _signal(pid: int | None, sig: int) -> None:
    if pid is not None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:  # it had already ended
            pass


def _stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` has stopped (or the process has gone)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks]
    except FileNotFoundError:
        return True
    return all(s in ("T", "t", "Z", "X") for s in states)


def _sigint_pending(pid: int) -> bool:
    """Whether SIGINT waits, undelivered, for ``pid`` (a stopped process gets it on SIGCONT)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & (
            1 << (signal.SIGINT - 1)
        ):
            return True
    return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_ctrl_c_leaves_a_truncated_trace_that_is_a_prefix(model, tmp_path, sig):
    """SIGINT (SIGTERM, SIGHUP) during a long generation: exit 128 + the signal, one line,
    and a trace complete up to a token."""
    out = tmp_path / "t.moetrace"
    args = ["trace", "capture", str(model), "-o", str(out), "-p", PROMPTS[0], "-n", "400", "-q"]
    proc = subprocess.Popen(
        [sys.executable, "-c", _CLI_WITH_CTRL_C, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    spool = None
    while proc.poll() is None:  # wait until routing is being spooled (no fixed sleep)
        found = [p for p in tmp_path.glob(".t.moetrace.*") if (p / "ids.bin").exists()]
        if found and (found[0] / "ids.bin").stat().st_size > 0:
            spool = found[0]
            break
        time.sleep(0.02)
    if spool is None:
        pytest.skip("the capture finished before it could be interrupted")
    # freeze the worker mid-generation, so that it cannot finish before the interrupt reaches
    # it; let it go on only once the CLI has passed the SIGINT on (pending in the worker)
    # (wait until it has stopped: a SIGINT that reached it first would be taken before the
    # SIGSTOP, since the lower signal number goes first, and never show as pending)
    worker = _only_child(proc.pid)
    _signal(worker, signal.SIGSTOP)
    deadline = time.monotonic() + 300
    while worker is not None and not _stopped(worker):
        assert time.monotonic() < deadline, "the worker never stopped"
        time.sleep(0.01)
    os.kill(proc.pid, sig)  # the CLI passes each interrupt on to the worker as SIGINT
    while worker is not None and proc.poll() is None and not _sigint_pending(worker):
        assert time.monotonic() < deadline, "the CLI never passed the SIGINT on"
        time.sleep(0.01)
    _signal(worker, signal.SIGCONT)
    _, err = proc.communicate(timeout=300)
    if proc.returncode == 0:  # only when the worker had ended before it was frozen
        pytest.skip("the capture finished before the interrupt arrived")
    assert proc.returncode == 128 + sig, err
    assert len(err.strip().splitlines()) == 1 and "truncated" in err
    t = load_trace(out)
    assert t.provenance["capture"]["truncated"] is True
    assert 0 < t.tokens < len(_tokenize(model, PROMPTS[0])) + 400
    # greedy decoding is deterministic: the prefix is what a shorter run records in full
    (seg,) = t.provenance["capture"]["prompts"]
    ref = tmp_path / "ref.moetrace"
    capture_trace(model, ref, [Prompt(text=PROMPTS[0])], CaptureOptions(n_predict=seg["decode"]))
    np.testing.assert_array_equal(np.asarray(t.ids), np.asarray(load_trace(ref).ids))
    assert not list(tmp_path.glob(".t.moetrace.*"))


def test_library_refuses_no_prompts(model, tmp_path):
    with pytest.raises(BadInput, match="no prompts"):
        capture_trace(model, tmp_path / "t.moetrace", [])


def _string_kv(key: str, value: str) -> bytes:
    k, v = key.encode(), value.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<IQ", 8, len(v)) + v


def test_chat_prompts_go_through_the_models_template(model, tmp_path):
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "[assistant]"
    )
    chat = craft_metadata(
        model,
        tmp_path / "chat.gguf",
        [raw for _, raw in metadata_entries(model)]
        + [_string_kv("tokenizer.chat_template", template)],
    )
    pf = tmp_path / "p.jsonl"
    pf.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "why experts?"},
                ]
            }
        )
        + "\n"
    )
    capture_trace(chat, tmp_path / "t.moetrace", read_prompt_file(pf), CaptureOptions())
    (seg,) = load_trace(tmp_path / "t.moetrace").provenance["capture"]["prompts"]
    rendered = "[system] be brief\n[user] why experts?\n[assistant]"  # after the BOS
    assert seg["prefill"] == len(_tokenize(chat, rendered))
