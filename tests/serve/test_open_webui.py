"""Open WebUI, the chat UI people point at Ollama, against ``moepack serve``'s Ollama API: its
connection with the key (``--api-key``), its model list, and a chat, plain and streamed, as its
own front end asks them (through Open WebUI's HTTP API, no browser).

Open WebUI is no test dependency: ``pip install open-webui`` pulls torch and CUDA wheels
(gigabytes). ``scripts/open_webui_venv.sh`` makes a venv of it without them, from PyPI alone;
point ``MOEPACK_OPEN_WEBUI`` at its ``open-webui`` executable to run this test (skipped
otherwise). It starts offline (``OFFLINE_MODE``), with its own data in a temporary folder."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from moefixtures import REPLY, replying_model
from served import Served

pytest.importorskip("llama_cpp.server", reason="moepack[serve] is installed by ./dev test")
pytestmark = pytest.mark.slow
WEBUI = os.environ.get("MOEPACK_OPEN_WEBUI", "")
if not WEBUI or not Path(WEBUI).is_file():
    pytest.skip(
        "MOEPACK_OPEN_WEBUI names no open-webui executable (scripts/open_webui_venv.sh makes one)",
        allow_module_level=True,
    )

KEY = "sk-test-webui"
START_SECONDS = 600


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Served]:
    model = replying_model(tmp_path_factory.mktemp("webui") / "m.gguf")
    with Served(model, "--ctx", 2048, "--threads", 1, "--api-key", KEY) as s:
        yield s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _call(base: str, path: str, body: Any = None, token: str | None = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    req = urllib.request.Request(base + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def webui(server, tmp_path_factory) -> Iterator[str]:
    port = _free_port()
    data = tmp_path_factory.mktemp("webui-data")
    env = {
        **os.environ,
        "DATA_DIR": str(data),
        "OLLAMA_BASE_URL": server.base,
        "ENABLE_OPENAI_API": "false",
        "WEBUI_AUTH": "False",
        "WEBUI_SECRET_KEY": "test",
        "OFFLINE_MODE": "true",
        "HF_HUB_OFFLINE": "1",
        "RAG_EMBEDDING_ENGINE": "ollama",
        "ENABLE_WEBSOCKET_SUPPORT": "false",
        "ANONYMIZED_TELEMETRY": "false",
        "DO_NOT_TRACK": "true",
        "SCARF_NO_ANALYTICS": "true",
    }
    log = open(data / "webui.log", "w")  # noqa: SIM115  (closed below)
    proc = subprocess.Popen([WEBUI, "serve", "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_SECONDS
        while True:
            assert proc.poll() is None, (data / "webui.log").read_text()[-3000:]
            try:
                if _call(base, "/api/config")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "Open WebUI did not start"
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_open_webui_lists_the_model_and_chats_through_the_ollama_api(server, webui):
    status, text = _call(
        webui, "/api/v1/auths/signin", {"email": "admin@localhost", "password": "x"}
    )
    assert status == 200, text
    token = json.loads(text)["token"]
    # Open WebUI's connection settings, with the server's key (a bearer token, as Ollama's)
    status, text = _call(webui, "/ollama/config/update", {
        "ENABLE_OLLAMA_API": True, "OLLAMA_BASE_URLS": [server.base],
        "OLLAMA_API_CONFIGS": {"0": {"key": KEY}}}, token)  # fmt: skip
    assert status == 200, text
    status, text = _call(webui, "/ollama/api/version", token=token)
    assert status == 200 and json.loads(text)["version"], text
    status, text = _call(webui, "/api/models", token=token)
    assert status == 200 and "m:latest" in [m["id"] for m in json.loads(text)["data"]], text
    ask = {"model": "m:latest", "messages": [{"role": "user", "content": "hello"}]}
    status, text = _call(webui, "/api/chat/completions", {**ask, "stream": False}, token)
    assert status == 200, text
    answer = json.loads(text)
    assert answer["choices"][0]["message"]["content"] == REPLY, text
    assert answer["choices"][0]["finish_reason"] == "stop"
    status, text = _call(webui, "/api/chat/completions", {**ask, "stream": True}, token)
    assert status == 200, text
    pieces = []
    for line in text.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            pieces += [c["delta"].get("content") or "" for c in chunk.get("choices", [])]
    assert "".join(pieces) == REPLY, text
    server.logged(lambda lines: sum("ollama POST /api/chat 200" in ln for ln in lines) >= 2)
