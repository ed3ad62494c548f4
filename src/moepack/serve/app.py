"""llama-cpp-python's server application, with moepack's model and additions.

The seam: ``llama_cpp.server.app.create_app`` takes settings, not a model — it builds its
``LlamaProxy``, which loads the ``Llama`` with llama-cpp-python's own loader (every setting,
chat format and template as ``python -m llama_cpp.server`` would) and keeps it in the
module's ``_llama_proxy``, where every route finds it. ``create_app`` is called as it is; the
proxy is read back from there (the one name used outside its public API, on the pinned
version) and the hook is attached to the ``Llama`` it loaded (``prefetching`` replaces the
context, as for any ``Llama``). No route is rewritten; three things are changed around them:

- settings are built with ``model_validate`` (pydantic-settings reads the environment only in
  ``__init__``: a stray ``API_KEY`` or ``N_CTX`` in the user's shell changes nothing) and
  ``interrupt_requests`` is off (on, a request waiting for the model cancels the stream in
  progress; off, requests queue on the one model);
- ``/v1/models`` is answered without waiting for the model's lock (its route takes the lock
  only because all routes share one dependency), so it answers while a generation runs;
- sse-starlette's automatic drain is off: on shutdown it would cancel every stream at once,
  where ``serve`` lets the requests in flight finish.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from .metrics import CONTENT_TYPE, RequestCounts, exposition
from .openai_errors import OpenAIErrors

SPECIAL_FORMATS = (
    "llava-1-5", "obsidian", "llava-1-6", "mtmd", "gemma4", "moondream", "nanollava",
    "llama-3-vision-alpha", "minicpm-v-2.6", "qwen2.5-vl", "hf-autotokenizer",
    "hf-tokenizer-config",
)  # fmt: skip
"""Chat formats whose handler needs files (a CLIP model, a tokenizer) ``serve`` does not take."""


@dataclass(frozen=True)
class AppSettings:
    """What the application is made with (``ServeOptions`` in the worker)."""

    model: str
    alias: str
    n_ctx: int
    threads: int
    batch: int
    chat_format: str | None
    logits_all: bool


def check_chat_format(name: str | None) -> None:
    """``BadInput`` for a chat format llama-cpp-python does not have (before the model loads)."""
    from llama_cpp import llama_chat_format

    from ..errors import BadInput

    if name is None:
        return
    if name in SPECIAL_FORMATS:
        raise BadInput(f"chat format {name!r} needs files `serve` does not take (a CLIP model "
                       "or a tokenizer)")  # fmt: skip
    try:
        llama_chat_format.get_chat_completion_handler(name)
    except Exception as e:  # llama-cpp-python's "not found", which lists the formats it has
        raise BadInput(f"llama-cpp-python has no chat format {name!r}: {e}") from None


def create(settings: AppSettings) -> tuple[Any, Any]:
    """llama-cpp-python's application and the ``Llama`` it loaded."""
    import llama_cpp.server.app as server_app
    from llama_cpp.server.settings import ModelSettings, ServerSettings
    from sse_starlette.sse import AppStatus

    server = ServerSettings.model_validate(
        {"host": "127.0.0.1", "port": 0, "api_key": None, "interrupt_requests": False}
    )
    model = ModelSettings.model_validate(
        {
            "model": settings.model,
            "model_alias": settings.alias,
            "n_ctx": settings.n_ctx,
            "n_batch": settings.batch,
            "n_ubatch": settings.batch,
            "n_threads": settings.threads,
            "n_threads_batch": settings.threads,
            "chat_format": settings.chat_format,
            "logits_all": settings.logits_all,
            # the prefetcher reads llama.cpp's mapping; a locked model could not be evicted
            "use_mmap": True,
            "use_mlock": False,
            "verbose": False,
        }
    )
    app = server_app.create_app(server_settings=server, model_settings=[model])
    proxy = server_app._llama_proxy
    assert proxy is not None
    AppStatus.disable_automatic_graceful_drain()

    async def models_unlocked(request: Request) -> AsyncIterator[Any]:
        if request.url.path.endswith("/v1/models"):
            yield proxy
            return
        async with asynccontextmanager(server_app.get_llama_proxy)() as locked:
            yield locked

    app.dependency_overrides[server_app.get_llama_proxy] = models_unlocked
    return app, proxy()


def add_moepack(
    app: Any, alias: str, counts: RequestCounts, metrics: Any, logits_all: bool
) -> None:
    """``/metrics``, and the OpenAI error shape in front of the completion routes."""
    from llama_cpp.server.app import router
    from llama_cpp.server.errors import RouteErrorHandler
    from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest

    # the wording of the application's own routes (any of them: it does not depend on the path)
    routes = [r for r in router.routes if isinstance(r, RouteErrorHandler)]
    assert routes, "llama-cpp-python's routes are not RouteErrorHandler routes"
    wording = routes[0]

    def describe(exc: Exception, body: BaseModel | None) -> tuple[int, dict[str, Any]]:
        status, problem = wording.error_message_wrapper(error=exc, body=body)  # type: ignore[arg-type]
        return int(status), dict(problem)

    async def metrics_endpoint(request: Request) -> Response:
        return Response(exposition(metrics), media_type=CONTENT_TYPE)

    app.add_route("/metrics", metrics_endpoint, methods=["GET"])
    app.add_middleware(
        OpenAIErrors,
        requests={
            "/v1/completions": CreateCompletionRequest,
            "/v1/engines/copilot-codex/completions": CreateCompletionRequest,
            "/v1/chat/completions": CreateChatCompletionRequest,
        },
        models=(alias,),
        describe=describe,
        counts=counts,
        logprobs=logits_all,
    )
