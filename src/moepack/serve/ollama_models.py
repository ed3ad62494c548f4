"""What Ollama's clients ask of the server before they chat: ``/api/tags``, ``/api/show``,
``/api/ps``, ``/api/version``, and ``GET /`` (``HEAD /``) probed for "Ollama is running".

The served model is described as Ollama describes a model it has pulled: its names (the plain
``--alias`` names, tagged ``:latest`` where they carry no tag, as Ollama lists them), the
file's size and modification time, a digest (SHA-256 of moepack's fingerprint of the file:
bound to its bytes without reading them whole), ``details`` (family: the GGUF architecture;
parameter size from llama.cpp's count; quantization from ``general.file_type``), and for
``/api/show`` the chat template, the GGUF metadata as ``model_info`` (numbers as numbers) and
``capabilities`` (``completion``, and ``tools`` where the chat format chooses calls itself).
``/api/ps`` shows it loaded for good (it stays while the server runs, whatever ``keep_alive``
said) with the served context.

``/`` stays the dashboard for a browser (a request that accepts ``text/html``); any other
client gets Ollama's own answer, ``Ollama is running`` in plain text.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from .names import LATEST, ModelNames

OLLAMA_VERSION = "0.12.0"
"""The Ollama release whose API the routes follow (``/api/version``): clients gate features
on it."""
RUNNING = b"Ollama is running"
FOREVER = "2318-01-01T00:00:00Z"
"""``expires_at`` of a model never unloaded."""


def timestamp(ns: int | None = None) -> str:
    """RFC 3339 in UTC with microseconds, as Ollama writes ``created_at``."""
    when = datetime.now(UTC) if ns is None else datetime.fromtimestamp(ns / 1e9, UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def tagged(name: str) -> str:
    """An Ollama model name: ``name:latest`` unless it carries a tag of its own."""
    return name if ":" in name else name + LATEST


@dataclass(frozen=True)
class OllamaModelFacts:
    """The served model as Ollama's listing and ``show`` describe it."""

    size: int
    digest: str
    modified_at: str
    family: str
    parameter_size: str
    quantization: str
    n_ctx: int
    template: str
    tools: bool
    info: dict[str, Any] = field(default_factory=dict)

    def details(self) -> dict[str, Any]:
        return {
            "parent_model": "",
            "format": "gguf",
            "family": self.family,
            "families": [self.family],
            "parameter_size": self.parameter_size,
            "quantization_level": self.quantization,
        }

    def entry(self, name: str) -> dict[str, Any]:
        """One model of ``/api/tags``."""
        return {
            "name": tagged(name),
            "model": tagged(name),
            "modified_at": self.modified_at,
            "size": self.size,
            "digest": self.digest,
            "details": self.details(),
        }

    def running(self, name: str) -> dict[str, Any]:
        """One model of ``/api/ps``."""
        return {
            "name": tagged(name),
            "model": tagged(name),
            "size": self.size,
            "digest": self.digest,
            "details": self.details(),
            "expires_at": FOREVER,
            "size_vram": 0,
            "context_length": self.n_ctx,
        }

    def show(self) -> dict[str, Any]:
        """``/api/show``."""
        return {
            "license": "",
            "modelfile": "# served by moepack serve (one GGUF file; no Modelfile)\n",
            "parameters": "",
            "template": self.template,
            "details": self.details(),
            "model_info": self.info,
            "capabilities": ["completion", *(["tools"] if self.tools else [])],
            "modified_at": self.modified_at,
        }


def facts_of(
    llm: Any, shards: list[str], fingerprint: str, n_ctx: int, tools: bool
) -> OllamaModelFacts:
    """The facts of the ``Llama`` llama-cpp-python loaded (its GGUF metadata) and its files."""
    import llama_cpp

    meta = {str(k): str(v) for k, v in dict(getattr(llm, "metadata", {}) or {}).items()}
    family = meta.get("general.architecture", "unknown")
    try:
        params = int(llama_cpp.llama_model_n_params(llm.model))
    except Exception:  # a build without the count: said as unknown
        params = 0
    info: dict[str, Any] = {k: _value(v) for k, v in meta.items() if k != "tokenizer.chat_template"}
    info["general.parameter_count"] = params
    size = sum(os.path.getsize(s) for s in shards)
    mtime = max(os.stat(s).st_mtime_ns for s in shards)
    return OllamaModelFacts(
        size=size,
        digest=hashlib.sha256(fingerprint.encode()).hexdigest(),
        modified_at=timestamp(mtime),
        family=family,
        parameter_size=_count(params),
        quantization=_quantization(meta.get("general.file_type")),
        n_ctx=n_ctx,
        template=meta.get("tokenizer.chat_template", ""),
        tools=tools,
        info=info,
    )


def _value(text: str) -> Any:
    """A metadata value as the number it spells, if it is one."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text in ("true", "false"):
        return text == "true"
    return text


def _count(n: int) -> str:
    if n <= 0:
        return "unknown"
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _quantization(file_type: str | None) -> str:
    from gguf import LlamaFileType

    try:
        name = LlamaFileType(int(file_type or "")).name
    except ValueError:
        return "unknown"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def listing(names: ModelNames, facts: OllamaModelFacts, running: bool = False) -> dict[str, Any]:
    """``/api/tags`` (``running``: ``/api/ps``): every plain name the model answers to."""
    of = facts.running if running else facts.entry
    return {"models": [of(n) for n in names.listed]}


class OllamaProbe:
    """``GET /`` and ``HEAD /`` from anything but a browser: Ollama's "Ollama is running" (an
    ASGI middleware; a browser's request, which accepts ``text/html``, goes on to the
    dashboard)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] == "/"
            and scope["method"] in ("GET", "HEAD")
            and not _browser(scope)
        ):
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/plain; charset=utf-8"),
                        (b"content-length", str(len(RUNNING)).encode()),
                    ],
                }
            )
            body = b"" if scope["method"] == "HEAD" else RUNNING
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        await self.app(scope, receive, send)


def _browser(scope: Scope) -> bool:
    for key, value in scope.get("headers", []):
        if key.lower() == b"accept" and b"text/html" in value.lower():
            return True
    return False
