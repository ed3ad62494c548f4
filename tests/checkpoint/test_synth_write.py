"""Writing synthetic models tensor by tensor: the values drawn in chunks are the values drawn
whole, the plan says the file's exact bytes, the free-space check asks for those bytes, the
progress bar counts them, the workers write the same file in any number, a full disk leaves
nothing, and memory is a chunk, not a tensor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tracemalloc
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import quantize

from moefixtures import run_cli, tiny_spec
from moepack.checkpoint.ggml_c import can_quantise
from moepack.checkpoint.routing import RoutingSpec
from moepack.checkpoint.synth import SynthSpec, synth_model
from moepack.checkpoint.synth_plan import plan_synth
from moepack.checkpoint.synth_values import tensor_values, value_chunks
from moepack.checkpoint.synth_write import encode, encoder_missing
from quantfixtures import HAVE_GGML

needs_ggml = pytest.mark.skipif(not HAVE_GGML, reason="llama-cpp-python (libggml-base) missing")

SPECS = {
    "qwen3moe": tiny_spec(),
    "routing": tiny_spec(routing=RoutingSpec(cluster_size=2), vocab=300),
    "deepseek2-routing": tiny_spec(
        arch="deepseek2", layers=3, routing=RoutingSpec(cluster_size=2), vocab=300
    ),
    "qwen35moe": tiny_spec(arch="qwen35moe", layers=4, linear_heads=4, linear_key_heads=2),
    "gpt-oss": tiny_spec(arch="gpt-oss"),
}


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("chunk", [1, 100, 1000, 1 << 20])
def test_values_drawn_in_chunks_are_the_values_drawn_whole(name, chunk):
    spec = SPECS[name]
    for t in spec.family.tensors(spec):
        pieces = list(value_chunks(spec, t, chunk))
        assert all(p.ndim == 2 and p.shape[1] == t.shape[-1] for p in pieces)
        whole = tensor_values(spec, t.name, t.shape, t.role)
        assert np.array_equal(np.concatenate(pieces).reshape(t.shape), whole), t.name


@pytest.mark.parametrize(
    "spec, split",
    [
        (tiny_spec(weight_type="Q8_0"), 0),
        (tiny_spec(weight_type="Q4_0", arch="glm4moe", layers=3, dense_ffn=96), 0),
        (tiny_spec(weight_type="F16", arch="qwen35moe", layers=4), 200_000),
        pytest.param(tiny_spec(weight_type="Q4_K_M", hidden=256), 0, marks=needs_ggml),
        pytest.param(tiny_spec(weight_type="MXFP4_MOE", arch="gpt-oss"), 40_000, marks=needs_ggml),
    ],
)
def test_the_plan_is_the_file_to_the_byte(tmp_path, spec, split):
    plan = plan_synth(spec, split)
    result = synth_model(tmp_path / "m.gguf", spec, split_max_size=split)
    assert [p.stat().st_size for p in result.paths] == plan.shard_bytes
    assert result.file_bytes == plan.file_bytes
    assert result.types == plan.type_counts()
    assert (len(result.paths) > 1) == bool(split)


@pytest.mark.parametrize("threads", [1, 3])
def test_any_number_of_workers_writes_the_same_file(tmp_path, threads):
    spec = tiny_spec(weight_type="Q8_0", layers=3, routing=RoutingSpec(cluster_size=2), vocab=300)
    one = synth_model(tmp_path / "a.gguf", spec, threads=1).paths[0].read_bytes()
    many = synth_model(tmp_path / "b.gguf", spec, threads=threads).paths[0].read_bytes()
    assert one == many


class _Recorder:
    def __init__(self) -> None:
        self.total: int | None = None
        self.advanced = 0
        self.finished = False

    def start(self, description: str, total: int, unit: str = "B") -> None:
        self.total = total

    def advance(self, amount: int) -> None:
        self.advanced += amount

    def finish(self) -> None:
        self.finished = True


@pytest.mark.parametrize(
    "weight_type",
    ["Q4_0", pytest.param("Q4_K_M", marks=needs_ggml), pytest.param("Q6_K", marks=needs_ggml)],
)
def test_the_progress_bar_counts_the_bytes_of_the_written_types(tmp_path, weight_type):
    spec = tiny_spec(weight_type=weight_type, hidden=256, expert_ffn=256)
    bar = _Recorder()
    synth_model(tmp_path / "m.gguf", spec, progress=bar)
    plan = plan_synth(spec)
    assert bar.total == bar.advanced == plan.tensor_bytes
    assert bar.finished
    assert plan.tensor_bytes < plan_synth(replace(spec, weight_type="F32")).tensor_bytes / 3


@needs_ggml
@pytest.mark.parametrize("qtype", [T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1])
def test_ggml_writes_the_direct_types_as_gguf_py_does(qtype):
    """The direct types are quantised by ggml when llama.cpp is installed: the same bytes as
    gguf-py's quantisers (models written before stay valid), only faster."""
    spec = tiny_spec(routing=RoutingSpec(cluster_size=2), vocab=300)
    for t in spec.family.tensors(spec):
        if t.stored_f32:
            continue
        rows = tensor_values(spec, t.name, t.shape, t.role).reshape(-1, t.shape[-1])
        ref = np.ascontiguousarray(quantize(rows, qtype)).view(np.uint8).reshape(-1)
        assert can_quantise(qtype) or qtype == T.F16
        assert np.array_equal(encode(rows, qtype), ref), (qtype.name, t.name)


def test_a_type_ggml_cannot_quantise_without_an_importance_matrix_is_named():
    why = encoder_missing({T.Q4_0, T.IQ2_XXS})
    assert why is not None and why.startswith("IQ2_XXS is quantised by llama.cpp's ggml")


def test_memory_is_a_chunk_per_worker_not_a_tensor(tmp_path):
    """Each expert tensor is 64 MiB of F32 values; Python's allocations (numpy's included)
    peak far below one of them."""
    spec = SynthSpec(
        layers=1, experts=64, top_k=2, hidden=512, expert_ffn=512, vocab=300, weight_type="Q8_0"
    )
    largest = max(int(np.prod(t.shape)) * 4 for t in spec.family.tensors(spec))
    assert largest == 64 << 20
    tracemalloc.start()
    try:
        synth_model(tmp_path / "m.gguf", spec, threads=2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < largest / 2, f"peak {peak:,} bytes"


# ------------------------------------------------------------------ free space (root: tmpfs)
@contextmanager
def _tmpfs(path: Path, size: int) -> Any:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def _quantised_spec() -> SynthSpec:
    return SynthSpec(layers=2, experts=16, hidden=256, expert_ffn=256, weight_type="Q4_0")


def test_the_free_space_check_asks_for_the_written_types_bytes(capsys, tmp_path):
    """A Q4_0 model fits on a disk with room for it, though not for its F32 values (it was
    refused for the F32 bytes); on a disk one page short it is refused before writing."""
    spec = _quantised_spec()
    need = plan_synth(spec).file_bytes
    assert plan_synth(replace(spec, weight_type="F32")).file_bytes > 5 * need
    room = (need // 4096 + 4) * 4096
    with _tmpfs(tmp_path / "fits", room) as disk:
        result = synth_model(disk / "m.gguf", spec)
        assert result.file_bytes == need
    with _tmpfs(tmp_path / "short", (need // 4096 - 1) * 4096) as disk:
        code, _, err = run_cli(
            capsys, "synth", "--out", disk / "m.gguf", "--layers", "2", "--hidden", "256",
            "--expert-ffn", "256", "--weight-type", "Q4_0", "-q",
        )  # fmt: skip
        assert code == 2
        assert f"needs {need:,} bytes" in err and err.count("\n") == 1
        assert list(disk.iterdir()) == []


def test_a_disk_that_fills_while_workers_write_leaves_nothing(capsys, tmp_path, monkeypatch):
    spec = _quantised_spec()
    need = plan_synth(spec).file_bytes
    monkeypatch.setattr("moepack.checkpoint.synth.check_free_space", lambda *a, **k: None)
    with _tmpfs(tmp_path / "half", (need // 2 // 4096) * 4096) as disk:
        code, _, err = run_cli(
            capsys, "synth", "--out", disk / "m.gguf", "--layers", "2", "--hidden", "256",
            "--expert-ffn", "256", "--weight-type", "Q4_0", "--threads", "2", "-q",
        )  # fmt: skip
        assert code == 2, err
        assert "no space left" in err and err.count("\n") == 1
        assert list(disk.iterdir()) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_while_workers_write_leaves_nothing(tmp_path, sig):
    """The signal lands once tensor data is being written (the staged file has grown past
    its header): the workers stop at their next chunk and the staging folder goes."""
    folder = tmp_path / "out"
    folder.mkdir()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moepack",
            "synth",
            "--out",
            folder / "m.gguf",
            "--layers",
            "8",
            "--experts",
            "64",
            "--hidden",
            "512",
            "--expert-ffn",
            "512",
            "--weight-type",
            "Q8_0",
            "--threads",
            "2",
            "-q",
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    header = plan_synth(
        SynthSpec(layers=8, experts=64, hidden=512, expert_ffn=512, weight_type="Q8_0")
    ).header_bytes[0]
    try:
        while proc.poll() is None:
            staged = [f for d in folder.iterdir() if d.is_dir() for f in d.iterdir()]
            if staged and staged[0].stat().st_blocks * 512 > header + (1 << 20):
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the model was written before the signal"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err
    lines = [ln for ln in err.splitlines() if ln]  # click ends a terminal's line first
    assert lines == ["moepack: interrupted; no output was written"], err
    assert list(folder.iterdir()) == []
