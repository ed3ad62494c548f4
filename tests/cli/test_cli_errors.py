"""Bad input through the real command line: one line, exit 2 (1 for failed verification),
no traceback, no partial output, inputs untouched."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType

from moefixtures import (
    ambiguous_model,
    craft_metadata,
    metadata_entries,
    run_cli,
    synth_with_trace,
    tiny_spec,
)
from moepack.checkpoint import MoeModel
from moepack.checkpoint.provenance import pack_kv
from moepack.checkpoint.synth import SynthSpec, synth_model
from moepack.layout.plan import LayerPlan, Plan, save_plan


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if "moepack-tmp" in p.name)


@pytest.fixture
def setup(tmp_path):
    model = synth_model(tmp_path / "m.gguf", tiny_spec()).paths[0]
    m = MoeModel(model)
    rng = np.random.default_rng(0)
    plan = Plan([LayerPlan(b.index, rng.permutation(b.n_expert)) for b in m.blocks], m.fingerprint)
    save_plan(plan, tmp_path / "p.moeplan")
    return model, tmp_path / "p.moeplan", digest(model)


def one_line_error(err: str, *needles: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("moepack: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_happy_path_json(capsys, setup, tmp_path):
    model, plan, _ = setup
    code, out, _ = run_cli(
        capsys,
        "repack",
        str(model),
        "--plan",
        str(plan),
        "--out",
        str(tmp_path / "r.gguf"),
        "--json",
    )
    assert code == 0 and json.loads(out)["tensors_permuted"] == 8
    code, out, _ = run_cli(capsys, "verify", str(model), str(tmp_path / "r.gguf"), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["permutation_source"] == "provenance"
    code, out, _ = run_cli(capsys, "inspect", str(tmp_path / "r.gguf"), "--json")
    assert (
        code == 0
        and json.loads(out)["provenance"]["moepack.repack.original_fingerprint"]
        == MoeModel(model).fingerprint
    )


def test_output_equal_to_input(capsys, setup):
    model, plan, before = setup
    code, _, err = run_cli(capsys, "repack", str(model), "--plan", str(plan), "--out", str(model))
    assert code == 2
    one_line_error(err, str(model), "overwrite the input")
    assert digest(model) == before and leftovers(model.parent) == []
    # also through another name for the same file
    link = model.parent / "alias.gguf"
    os.link(model, link)
    code, _, err = run_cli(capsys, "repack", str(model), "--plan", str(plan), "--out", str(link))
    assert code == 2 and "overwrite the input" in err and digest(model) == before


def test_missing_output_folder(capsys, setup, tmp_path):
    model, plan, _ = setup
    code, _, err = run_cli(
        capsys,
        "repack",
        str(model),
        "--plan",
        str(plan),
        "--out",
        str(tmp_path / "nope" / "r.gguf"),
    )
    assert code == 2
    one_line_error(err, "does not exist")


def test_plan_for_another_model(capsys, setup, tmp_path):
    model, plan, before = setup
    other = synth_model(tmp_path / "o.gguf", tiny_spec(seed=4)).paths[0]
    code, _, err = run_cli(
        capsys, "repack", str(other), "--plan", str(plan), "--out", str(tmp_path / "r.gguf")
    )
    assert code == 2
    one_line_error(err, "p.moeplan", "another model")
    assert not (tmp_path / "r.gguf").exists()


@pytest.mark.parametrize(
    "text, needle",
    [
        (
            '{"format": "moepack-plan", "version": 1, "layers": [{"block": 0, "perm": [0,1,2,3,4,5,6,6]}]}',
            "not a permutation",
        ),
        (
            '{"format": "moepack-plan", "version": 1, "layers": [{"block": 7, "perm": [0,1,2,3,4,5,6,7]}]}',
            "block 7 is not a MoE block",
        ),
        ('{"format": "moepack-plan", "version": 9, "layers": []}', "unsupported plan version 9"),
        ('{"format": "moepack-plan", "version": 1, "layers": [', "corrupt"),
        ("pmxplan 1\nlayer 0 experts 8\nperm 0,1,2\n", "says 8 experts but its perm has 3"),
        ("pmxplan 2\n", "expected 'pmxplan 1'"),
        ("hello", "not a plan"),
    ],
)
def test_bad_plans(capsys, setup, tmp_path, text, needle):
    model, _, before = setup
    bad = tmp_path / "bad.plan"
    bad.write_text(text)
    code, _, err = run_cli(
        capsys, "repack", str(model), "--plan", str(bad), "--out", str(tmp_path / "r.gguf")
    )
    assert code == 2
    one_line_error(err, "bad.plan", needle)
    assert (
        digest(model) == before and not (tmp_path / "r.gguf").exists() and leftovers(tmp_path) == []
    )


def test_truncated_model(capsys, setup, tmp_path):
    model, plan, _ = setup
    bad = tmp_path / "t.gguf"
    bad.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    code, _, err = run_cli(capsys, "inspect", str(bad))
    assert code == 2
    one_line_error(err, "t.gguf", "past the end of the file")
    code, _, err = run_cli(
        capsys, "repack", str(bad), "--plan", str(plan), "--out", str(tmp_path / "r.gguf")
    )
    assert code == 2 and not (tmp_path / "r.gguf").exists()


def test_failed_verification_exits_1_naming_the_difference(capsys, setup, tmp_path):
    model, plan, _ = setup
    run_cli(capsys, "repack", str(model), "--plan", str(plan), "--out", str(tmp_path / "r.gguf"))
    r = MoeModel(tmp_path / "r.gguf")
    t = r.blocks[1].tensors[2]
    data = bytearray((tmp_path / "r.gguf").read_bytes())
    data[t.slice_offset(3) + 10] ^= 0x40
    (tmp_path / "r.gguf").write_bytes(bytes(data))
    code, out, err = run_cli(capsys, "verify", str(model), str(tmp_path / "r.gguf"))
    assert code == 1
    assert "VERIFICATION FAILED" in out and f"{t.name}" in out and "slice 3" in out
    one_line_error(err, "slice 3")


def _mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0:
        return False
    path.mkdir()
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


def test_full_disk(capsys, setup, tmp_path, monkeypatch):
    model, plan, before = setup
    small = tmp_path / "small"
    if not _mount_tmpfs(small, f"{model.stat().st_size // 2 // 1024}k"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        # the up-front free-space check
        code, _, err = run_cli(
            capsys, "repack", str(model), "--plan", str(plan), "--out", str(small / "r.gguf")
        )
        assert code == 2
        one_line_error(err, "not enough free space")
        # and the disk filling up mid-write (skip the up-front check to get there)
        monkeypatch.setattr("moepack.rewrite.write_target.check_free_space", lambda *a, **k: None)
        code, _, err = run_cli(
            capsys, "repack", str(model), "--plan", str(plan), "--out", str(small / "r.gguf")
        )
        assert code == 2
        one_line_error(err, "no space left on device")
        assert list(small.iterdir()) == [] and digest(model) == before
    finally:
        subprocess.run(["umount", str(small)], check=False)


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("big")
    big = synth_model(
        d / "big.gguf",
        SynthSpec(layers=8, experts=16, hidden=512, expert_ffn=512, weight_type="F32"),
    ).paths[0]
    m = MoeModel(big)
    plan = Plan(
        [LayerPlan(b.index, np.arange(b.n_expert)[::-1].copy()) for b in m.blocks], m.fingerprint
    )
    save_plan(plan, d / "p.moeplan")
    return big, d / "p.moeplan"


# The repack in a child that sends itself the signal after its first copied chunk: the
# signal lands while the output is being written, whatever the machine's speed.
MID_WRITE_CHILD = """
import os, sys
signum = int(sys.argv[1])
sys.argv = ["moepack", *sys.argv[2:]]
from moepack.entry import main
from moepack.rewrite import repack, write_target
real_copy_ranges = repack.copy_ranges
def copy_then_signal(copier, ranges, done=None, *args, **kwargs):
    fired = []
    def done_then_signal(n):
        if done is not None:
            done(n)
        if not fired:
            fired.append(n)
            os.kill(os.getpid(), signum)
    real_copy_ranges(copier, ranges, done_then_signal, *args, **kwargs)
repack.copy_ranges = write_target.copy_ranges = copy_then_signal
main()
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_interrupt_mid_write_leaves_nothing(tmp_path, big_model, sig):
    big, plan = big_model
    before = digest(big)
    out = tmp_path / "out.gguf"
    cmd = [sys.executable, "-c", MID_WRITE_CHILD, str(int(sig))]
    cmd += ["repack", str(big), "--plan", str(plan), "--out", str(out), "-q"]
    proc = subprocess.run(cmd, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                          timeout=120)  # fmt: skip
    err = proc.stderr
    assert proc.returncode == 128 + sig, err
    assert err.strip() == "moepack: interrupted; no output was written", err
    assert leftovers(tmp_path) == [] and not out.exists()
    assert digest(big) == before


def test_interrupt_mid_layout_rewrite_leaves_nothing(tmp_path, big_model):
    big, plan = big_model
    before = digest(big)
    out = tmp_path / "out.gguf"
    cmd = [sys.executable, "-c", MID_WRITE_CHILD, str(int(signal.SIGINT)), "repack", str(big)]
    cmd += ["--plan", str(plan), "--layout", "pipeline", "--align", "4096", "--out", str(out)]
    proc = subprocess.run(
        cmd + ["-q"], stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, timeout=120
    )
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr
    assert proc.stderr.strip() == "moepack: interrupted; no output was written", proc.stderr
    assert leftovers(tmp_path) == [] and not out.exists()
    assert digest(big) == before


def test_output_equal_to_the_plan(capsys, setup, tmp_path):
    model, plan, _ = setup
    saved = plan.read_bytes()
    code, _, err = run_cli(capsys, "repack", str(model), "--plan", str(plan), "--out", str(plan))
    assert code == 2 and "overwrite the input" in err
    assert plan.read_bytes() == saved


def test_undo_restores_the_original(capsys, setup, tmp_path):
    model, plan, before = setup
    run_cli(
        capsys, "repack", str(model), "--plan", str(plan), "--out", str(tmp_path / "r.gguf"), "-q"
    )
    code, _, err = run_cli(
        capsys,
        "repack",
        str(tmp_path / "r.gguf"),
        "--undo",
        "--out",
        str(tmp_path / "back.gguf"),
        "-q",
    )
    assert code == 0, err
    assert digest(tmp_path / "back.gguf") == before
    code, _, err = run_cli(
        capsys, "repack", str(model), "--undo", "--out", str(tmp_path / "x.gguf")
    )
    assert code == 2 and "nothing to undo" in err
    code, _, err = run_cli(capsys, "repack", str(model), "--out", str(tmp_path / "x.gguf"))
    assert code == 2 and "give --plan PLAN, --layout LAYOUT, --align N, or --undo" in err


def test_assume_options_on_repack_and_verify(capsys, tmp_path):
    path = ambiguous_model(tmp_path / "x.gguf")
    save_plan(Plan([LayerPlan(0, np.array([1, 0, 3, 2]))], None), tmp_path / "p.moeplan")
    args = [
        "repack",
        str(path),
        "--plan",
        str(tmp_path / "p.moeplan"),
        "--out",
        str(tmp_path / "r.gguf"),
    ]
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and "--assume-expert" in err
    code, out, err = run_cli(capsys, *args, "--assume-expert", "*ffn_odd*", "--json")
    assert code == 0 and json.loads(out)["tensors_permuted"] == 4
    code, _, _ = run_cli(capsys, "verify", str(path), str(tmp_path / "r.gguf"))
    assert code == 1
    code, _, _ = run_cli(
        capsys, "verify", str(path), str(tmp_path / "r.gguf"), "--assume-expert", "*ffn_odd*"
    )
    assert code == 0


def test_synth_refuses_an_unknown_trace_extension_before_writing(capsys, tmp_path):
    code, _, err = run_cli(
        capsys, "synth", "--out", str(tmp_path / "m.gguf"), "--trace-out", str(tmp_path / "t.xyz")
    )
    assert code == 2 and "trace format" in err
    assert list(tmp_path.iterdir()) == []


def test_plan_phase_without_tokens(capsys, tmp_path):
    model, trace = synth_with_trace(capsys, tmp_path, "--tokens", "300")
    code, _, err = run_cli(
        capsys,
        "plan",
        str(model),
        "--trace",
        str(trace),
        "--out",
        str(tmp_path / "p.moeplan"),
        "--phase",
        "prefill",
    )
    assert code == 2 and "no prefill tokens" in err
    assert not (tmp_path / "p.moeplan").exists()


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("qwen3moe.expert_count", "eight", "must be an integer"),
        ("qwen3moe.block_count", 2**31 - 1, "qwen3moe.block_count is 2,147,483,647"),  # refused
        ("general.architecture", 7, "architecture"),
    ],
)
def test_metadata_of_the_wrong_type(capsys, tmp_path, key, value, needle):
    from moefixtures import write_gguf

    kv = {"qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2, "qwen3moe.block_count": 1}
    kv[key] = value
    tensors = {"blk.0.ffn_gate_inp.weight": (4, 32), "blk.0.ffn_up_exps.weight": (4, 32, 32)}
    path = write_gguf(tmp_path / "x.gguf", "qwen3moe", tensors, kv)
    if key == "general.architecture":  # GGUFWriter writes the architecture itself: replace it
        kvs = [
            pack_kv(k, GGUFValueType.UINT32, value) if k == key else raw
            for k, raw in metadata_entries(path)
        ]
        craft_metadata(path, path, kvs)
    code, out, err = run_cli(capsys, "inspect", str(path), "--json")
    if needle is None:
        assert code == 0 and json.loads(out)["moe_blocks"] == [0]
    else:
        assert code == 2, err
        one_line_error(err, needle)


def test_trace_convert_never_writes_over_the_model(capsys, tmp_path):
    model, trace = synth_with_trace(capsys, tmp_path, "--tokens", "100")
    before = digest(model)
    code, _, err = run_cli(
        capsys, "trace", "convert", trace, model, "--to", "moetrace", "--model", model
    )
    assert code == 2
    one_line_error(err, "overwrite the input")
    assert digest(model) == before


def test_pairs_of_outputs_appear_together_or_not_at_all(capsys, tmp_path, monkeypatch):
    """plan + --map and synth + --trace-out on a disk with room for one file only."""
    model, trace = synth_with_trace(capsys, tmp_path)
    small = tmp_path / "small"
    if not _mount_tmpfs(small, "16k"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        code, _, err = run_cli(
            capsys,
            "plan",
            model,
            "--trace",
            trace,
            "--out",
            small / "p.moeplan",
            "--map",
            small / "map.png",
        )
        assert code == 2 and "no space left" in err
        assert list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)], check=False)
    size = model.stat().st_size
    if not _mount_tmpfs(tmp_path / "mid", f"{(size + 8192) // 1024 + 64}k"):
        pytest.skip("needs root to mount a small tmpfs")
    mid = tmp_path / "mid"
    # past the up-front estimate, to the disk filling up while the trace is written
    monkeypatch.setattr("moepack.checkpoint.synth.check_free_space", lambda *a, **k: None)
    try:
        code, _, err = run_cli(
            capsys, "synth", "--out", mid / "m.gguf", "--trace-out", mid / "t.moetrace", "--experts", "16", "--top-k", "4",
            "--tokens", "200000", "-q",
        )  # fmt: skip
        assert code == 2, err
        one_line_error(err, "no space left")
        assert list(mid.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mid)], check=False)
