"""Bad input through the real command line: one line, exit 2 (1 for failed verification),
no traceback, no partial output, inputs untouched."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moefixtures import tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.synth import SynthSpec, synth_model
from moepack.cli.main import main
from moepack.layout.plan import LayerPlan, Plan, save_plan


def run(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


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
    code, out, _ = run(
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
    code, out, _ = run(capsys, "verify", str(model), str(tmp_path / "r.gguf"), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["permutation_source"] == "provenance"
    code, out, _ = run(capsys, "inspect", str(tmp_path / "r.gguf"), "--json")
    assert (
        code == 0
        and json.loads(out)["provenance"]["moepack.repack.original_fingerprint"]
        == MoeModel(model).fingerprint
    )


def test_output_equal_to_input(capsys, setup):
    model, plan, before = setup
    code, _, err = run(capsys, "repack", str(model), "--plan", str(plan), "--out", str(model))
    assert code == 2
    one_line_error(err, str(model), "overwrite the input")
    assert digest(model) == before and leftovers(model.parent) == []
    # also through another name for the same file
    link = model.parent / "alias.gguf"
    os.link(model, link)
    code, _, err = run(capsys, "repack", str(model), "--plan", str(plan), "--out", str(link))
    assert code == 2 and "overwrite the input" in err and digest(model) == before


def test_missing_output_folder(capsys, setup, tmp_path):
    model, plan, _ = setup
    code, _, err = run(
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
    code, _, err = run(
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
    code, _, err = run(
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
    code, _, err = run(capsys, "inspect", str(bad))
    assert code == 2
    one_line_error(err, "t.gguf", "past the end of the file")
    code, _, err = run(
        capsys, "repack", str(bad), "--plan", str(plan), "--out", str(tmp_path / "r.gguf")
    )
    assert code == 2 and not (tmp_path / "r.gguf").exists()


def test_failed_verification_exits_1_naming_the_difference(capsys, setup, tmp_path):
    model, plan, _ = setup
    run(capsys, "repack", str(model), "--plan", str(plan), "--out", str(tmp_path / "r.gguf"))
    r = MoeModel(tmp_path / "r.gguf")
    t = r.blocks[1].tensors[2]
    data = bytearray((tmp_path / "r.gguf").read_bytes())
    data[t.slice_offset(3) + 10] ^= 0x40
    (tmp_path / "r.gguf").write_bytes(bytes(data))
    code, out, err = run(capsys, "verify", str(model), str(tmp_path / "r.gguf"))
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
        code, _, err = run(
            capsys, "repack", str(model), "--plan", str(plan), "--out", str(small / "r.gguf")
        )
        assert code == 2
        one_line_error(err, "not enough free space")
        # and the disk filling up mid-write (skip the up-front check to get there)
        monkeypatch.setattr("moepack.rewrite.repack.check_free_space", lambda *a, **k: None)
        code, _, err = run(
            capsys, "repack", str(model), "--plan", str(plan), "--out", str(small / "r.gguf")
        )
        assert code == 2
        one_line_error(err, "no space left on device")
        assert list(small.iterdir()) == [] and digest(model) == before
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_ctrl_c_mid_write_leaves_nothing(tmp_path):
    big = synth_model(
        tmp_path / "big.gguf",
        SynthSpec(layers=8, experts=16, hidden=512, expert_ffn=512, weight_type="F32"),
    ).paths[0]
    m = MoeModel(big)
    plan = Plan(
        [LayerPlan(b.index, np.arange(b.n_expert)[::-1].copy()) for b in m.blocks], m.fingerprint
    )
    save_plan(plan, tmp_path / "p.moeplan")
    before = digest(big)
    exe = Path(sys.executable).with_name("moepack")
    proc = subprocess.Popen(
        [
            str(exe),
            "repack",
            str(big),
            "--plan",
            str(tmp_path / "p.moeplan"),
            "--out",
            str(tmp_path / "out.gguf"),
            "-q",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 30
    while not leftovers(tmp_path) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    assert leftovers(tmp_path), "the repack never started writing"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    one_line_error(err, "interrupted")
    assert leftovers(tmp_path) == [] and not (tmp_path / "out.gguf").exists()
    assert digest(big) == before
