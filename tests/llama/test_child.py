"""The one way llama.cpp runs in a child: a dead worker is one line, a killed parent takes its
worker with it, and what the killed run left is swept by the next one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moefixtures import tiny_spec
from moepack import interrupts
from moepack.checkpoint.synth import synth_model
from moepack.llama.judge.judge import run_logits
from moepack.llama.protocol.child import LlamaFailed, failure, run_worker
from moepack.serve.server import StopAccount

pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")


def test_a_dead_worker_is_named_by_its_signal_or_its_last_words():
    m = Path("m.gguf")
    assert str(failure(-6, "x.cpp:3: GGML_ASSERT(a) failed", m)) == (
        "m.gguf: llama.cpp could not run this model: it aborted (SIGABRT): x.cpp:3: "
        "GGML_ASSERT(a) failed"
    )
    assert str(failure(-9, None, m)).endswith("it aborted (SIGKILL)")
    assert str(failure(1, None, None)) == (
        "llama.cpp could not run this model: the worker exited with status 1"
    )
    assert str(failure(1, "bad\nline", m)).count("\n") == 0
    # native code's own error line (the expert pager's) is not prefixed twice
    assert str(failure(1, "moepack: error: the expert pager cannot serve a fault", m)) == (
        "m.gguf: llama.cpp could not run this model: the expert pager cannot serve a fault"
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("child")
    spec = tiny_spec(layers=2, experts=8, top_k=2, seed=3, context=32768)
    return synth_model(d / "m.gguf", spec).paths[0]


@pytest.mark.slow
def test_an_abort_in_llama_cpp_is_one_line_with_its_reason(model, tmp_path):
    raw = bytearray(model.read_bytes())
    key = b"qwen3moe.expert_count"
    at = raw.find(key)
    raw[at : at + len(key)] = b"qwen3moe.expert_cOunt"  # same length: llama.cpp sees none
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(bytes(raw))
    with pytest.raises(LlamaFailed) as e:
        run_logits(broken, np.array([1, 5, 6]))
    text = str(e.value)
    assert "llama.cpp could not run this model: it aborted (SIGABRT)" in text
    assert "GGML_ASSERT" in text and "\n" not in text and "/tmp/pip" not in text


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


@pytest.mark.slow
def test_a_killed_parent_takes_its_worker_and_the_next_run_sweeps_its_spool(model, tmp_path):
    out = tmp_path / "t.moetrace"
    cli = [sys.executable, "-m", "moepack", "trace", "capture", str(model), "-o", str(out)]
    proc = subprocess.Popen(
        [*cli, "-p", "the quick brown fox", "-n", "30000", "--ctx", "32768", "-q"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    spool: Path | None = None
    while spool is None:  # wait until routing is being spooled (no fixed sleep)
        assert proc.poll() is None, "the capture ended before it could be killed"
        assert time.monotonic() < deadline, "the capture never started spooling"
        found = [p for p in tmp_path.glob(".t.moetrace.*") if (p / "ids.bin").exists()]
        if found and (found[0] / "ids.bin").stat().st_size > 0:
            spool = found[0]
        time.sleep(0.02)
    (worker,) = _children(proc.pid)
    # frozen, the worker cannot notice the parent's death itself (a write to the closed
    # event pipe would end it): only the kernel's death signal can
    os.kill(worker, signal.SIGSTOP)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        while not _gone(worker):
            assert time.monotonic() < deadline, "the worker outlived its killed parent"
            time.sleep(0.02)
    finally:
        if not _gone(worker):
            os.kill(worker, signal.SIGKILL)
    assert spool.exists()  # a SIGKILL leaves it: the next run into the folder sweeps it
    again = subprocess.run([*cli, "-p", "hi", "-n", "1"], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert "removed 1 leftover(s) of killed runs" in again.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.moetrace"]


_ANSWERING_WORKER = """
import sys, time
from moepack.llama.protocol.child import worker_main

def body(job, channel):
    channel.send("request", id="req_1")  # the server answered a request
    deadline = time.monotonic() + 120
    while not channel.stopping:  # until the parent passes the stop on
        if time.monotonic() > deadline:
            return {"stopped": False}
        time.sleep(0.01)
    return {"stopped": True}

sys.exit(worker_main(sys.argv[1:], body))
"""


class _StopAsTheLineIsRead:
    """The worker's event pipe, read as ``run_worker`` reads it, with ``sig`` raised in this
    process the instant the line of an answered request has been read: the widest form of
    a stop that comes together with the server's last answer."""

    def __init__(self, events, sig: int) -> None:
        self.events, self.sig = events, sig

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.events.close()

    def __iter__(self):
        return self

    def __next__(self) -> str:
        line = next(self.events)
        if '"request"' in line:
            signal.raise_signal(self.sig)
        return line


@pytest.mark.parametrize(
    ("sig", "cli"),
    [(signal.SIGTERM, True), (signal.SIGINT, True), (signal.SIGINT, False)],
    ids=["sigterm-cli", "sigint-cli", "sigint-library"],
)
def test_a_stop_as_the_last_answer_is_read_still_counts_it(tmp_path, monkeypatch, sig, cli):
    """The stop line counted the answers the worker reported: an interrupt raised as the
    parent read the last one lost it ("answered 3 requests" where the client had 4). The
    interrupt is passed on to the worker from the handler, and the line is kept."""
    (tmp_path / "answering_worker.py").write_text(_ANSWERING_WORKER)
    real_fdopen = os.fdopen
    monkeypatch.setattr(
        os, "fdopen", lambda fd, *a, **kw: _StopAsTheLineIsRead(real_fdopen(fd, *a, **kw), sig)
    )
    account = StopAccount()
    saved = interrupts.saved_handlers()
    if cli:
        interrupts.install()  # the command line's handlers, as under `moepack serve`
    try:
        outcome = run_worker(
            "answering_worker", {}, folder=tmp_path, on_event=account.see,
            env={"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])},
        )  # fmt: skip
    finally:
        interrupts.restore(saved)
    assert outcome.interrupted and outcome.done["stopped"] is True
    assert account.words() == "the server answered 1 request"
    if cli:
        assert interrupts.last_signal() == sig  # the exit code says which signal stopped it
