"""``moepack serve`` as a user starts it (``python -m moepack serve``), for the server tests:
started on a port the system picks, ready when it prints its URL (read, never slept for),
stopped with a signal; its stdout and stderr read as they come."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import pytest

STARTUP_SECONDS = 300
STOP_SECONDS = 300
REQUEST_LINE = re.compile(r'^(req_\d+ |\{"id": "req_)')
"""The start of a line of the request log (text or ``--log-json``)."""


class Served:
    """One ``moepack serve MODEL --port 0 ARGS...`` process."""

    def __init__(self, model: Path, *args: object) -> None:
        cmd = [sys.executable, "-m", "moepack", "serve", str(model), "--port", "0"]
        self.proc = subprocess.Popen(
            [*cmd, *(str(a) for a in args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        self.stdout: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        self._threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self.stdout.put)),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr.append)),
        ]
        for t in self._threads:
            t.daemon = True
            t.start()
        self.url = self._wait_for_url()
        self.base = self.url.removesuffix("/v1")

    @staticmethod
    def _pump(stream: IO[str] | None, put: Any) -> None:
        assert stream is not None
        for line in stream:
            put(line)

    def _wait_for_url(self) -> str:
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            try:
                line = self.stdout.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    self._join()
                    pytest.fail(f"moepack serve ended before it listened: {''.join(self.stderr)}")
                continue
            found = re.search(r"(http://\S+/v1)", line)
            if found:
                return found.group(1)
        self.proc.kill()
        pytest.fail("moepack serve did not listen in time")

    def _join(self) -> None:
        for t in self._threads:
            t.join(timeout=30)

    def client(self) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=600)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.base + path, timeout=600) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, path: str, body: bytes) -> tuple[int, str]:
        req = urllib.request.Request(
            self.base + path, data=body, headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self) -> dict[str, float]:
        """``/metrics`` parsed by prometheus-client's own parser: ``name{labels}`` -> value."""
        from prometheus_client.parser import text_string_to_metric_families

        status, text = self.get("/metrics")
        assert status == 200
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_idle(self) -> dict[str, float]:
        """Poll ``/metrics`` until no request is in flight; the metrics then."""
        deadline = time.monotonic() + STOP_SECONDS
        while True:
            m = self.metrics()
            if m["moepack_requests_in_flight"] == 0:
                return m
            assert time.monotonic() < deadline, "a request stayed in flight"
            time.sleep(0.05)

    def requests(self) -> list[str]:
        """The request log's lines on stderr so far."""
        return [line.rstrip("\n") for line in list(self.stderr) if REQUEST_LINE.match(line)]

    def logged(self, until: Callable[[list[str]], bool]) -> list[str]:
        """The request log's lines once ``until`` holds of them: a request's line reaches
        stderr through the parent a moment after its client has the answer (waited for)."""
        deadline = time.monotonic() + STOP_SECONDS
        while not until(lines := self.requests()):
            assert time.monotonic() < deadline, f"the request log fell behind: {lines[-5:]}"
            time.sleep(0.05)
        return lines

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, list[str]]:
        """Signal the server; its exit status and the non-empty lines of its stderr other
        than the request log's (``requests``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail("moepack serve did not stop")
        self._join()
        lines = [line.rstrip("\n") for line in self.stderr if line.strip()]
        return self.proc.returncode, [line for line in lines if not REQUEST_LINE.match(line)]

    def __enter__(self) -> Served:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.proc.poll() is None:
            self.stop()


def logit_bias(model: Path, *, endless: bool = False, ascii: bool = True) -> dict[str, int]:
    """``logit_bias`` that bans the byte tokens of 0x80 and above (``ascii``), so that the
    text reads as ASCII, and with ``endless`` the end-of-sequence token too, so that a
    generation runs to its ``max_tokens``. A synthetic model's greedy bytes are arbitrary:
    most of its high bytes make no UTF-8, which the plain text drops (moepack streams it the
    same: ``serve.textstream``)."""
    from moepack.checkpoint.gguf_file import GgufFile

    g = GgufFile(model)
    names = g.get("tokenizer.ggml.tokens")
    high = {f"<0x{b:02X}>" for b in range(0x80, 0x100)}
    bias = {str(i): -100 for i, name in enumerate(names) if ascii and name in high}
    if endless:
        bias[str(g.get_int("tokenizer.ggml.eos_token_id"))] = -100
    g.close()
    return bias
