"""llama-cpp-python's server application, with moepack's model and additions.

The seam: ``llama_cpp.server.app.create_app`` takes settings, not a model — it builds its
``LlamaProxy``, which loads the ``Llama`` with llama-cpp-python's own loader (every setting,
chat format and template as ``python -m llama_cpp.server`` would) and keeps it in the
module's ``_llama_proxy``, where every route finds it. ``create_app`` is called as it is; the
proxy is read back from there (the one name used outside its public API, on the pinned
version) and the hook is attached to the ``Llama`` it loaded (``prefetching`` replaces the
context, as for any ``Llama``). One route is replaced (below); around the others:

- settings are built with ``model_validate`` (pydantic-settings reads the environment only in
  ``__init__``: a stray ``API_KEY`` or ``N_CTX`` in the user's shell changes nothing) and
  ``interrupt_requests`` is off (on, a request waiting for the model cancels the stream in
  progress; off, requests queue on the one model);
- ``/v1/models`` is answered without waiting for the model's lock (its route takes the lock
  only because all routes share one dependency), so it answers while a generation runs;
- sse-starlette's automatic drain is off: on shutdown it would cancel every stream at once,
  where ``serve`` ends them itself;
- the guard (``guard``) stands in front of everything, with the checks of ``validate`` on each
  route's body: only the routes of ``openai_routes`` are answered, every error in the API's
  shape (``shapes``); ``/extras/detokenize`` is moepack's own (the same request and answer).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route as StarletteRoute

from .checks import token_budget
from .guard import MAX_BODY, PARSED, Guard, Route
from .metrics import CONTENT_TYPE, RequestCounts, exposition
from .names import ModelNames
from .openai_errors import OpenAIErrors
from .openai_fields import OpenAIFields, models_list
from .shapes import ApiProblem, Refused, Shapes
from .validate import BodyChecks

SPECIAL_FORMATS = (
    "llava-1-5",
    "obsidian",
    "llava-1-6",
    "mtmd",
    "gemma4",
    "moondream",
    "nanollava",
    "llama-3-vision-alpha",
    "minicpm-v-2.6",
    "qwen2.5-vl",
    "hf-autotokenizer",
    "hf-tokenizer-config",
)
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
    threads_batch: int | None = None  # passes of more than one token (default: threads)


def check_chat_format(name: str | None) -> None:
    """``BadInput`` for a chat format llama-cpp-python does not have (before the model loads)."""
    from llama_cpp import llama_chat_format

    from ..errors import BadInput

    if name is None:
        return
    if name in SPECIAL_FORMATS:
        raise BadInput(
            f"chat format {name!r} needs files `serve` does not take (a CLIP model or a tokenizer)"
        )
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
            "n_threads_batch": settings.threads_batch or settings.threads,
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
    app: Any,
    llm: Any,
    requests: BodyChecks,
    counts: RequestCounts,
    metrics: Any,
    *,
    max_body: int = MAX_BODY,
    shapes: Shapes | None = None,
    names: ModelNames | None = None,
) -> dict[str, Route]:
    """``/metrics``, the guard in front of everything, and the OpenAI error shape in front of
    the completion routes. Only the paths of ``openai_routes`` are answered (not
    llama-cpp-python's embeddings, which a model loaded for completions refuses with a 500,
    nor its API docs): the table is returned, for an API added beside to add its own.
    ``/v1/models`` lists ``names``' plain names (``models_list``)."""
    from llama_cpp.server.app import router
    from llama_cpp.server.errors import RouteErrorHandler
    from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest

    # the wording of the application's own routes (any of them: it does not depend on the path)
    handlers = [r for r in router.routes if isinstance(r, RouteErrorHandler)]
    assert handlers, "llama-cpp-python's routes are not RouteErrorHandler routes"
    wording = handlers[0]

    def describe(exc: Exception, body: BaseModel | None) -> ApiProblem:
        if isinstance(exc, Refused):
            return exc.problem
        status, error = wording.error_message_wrapper(error=exc, body=body)  # type: ignore[arg-type]
        e: dict[str, Any] = dict(error)
        return ApiProblem(int(status), str(e["message"]), e["param"], e["code"], str(e["type"]))

    async def metrics_endpoint(request: Request) -> Response:
        return Response(exposition(metrics), media_type=CONTENT_TYPE)

    async def detokenize(request: Request) -> Response:
        # llama-cpp-python's own decodes strictly: bytes that are not text (a token that is
        # part of a character) would be a 500; here they read as U+FFFD, as a trace's text
        from llama_cpp.server.types import DetokenizeInputRequest

        body = DetokenizeInputRequest.model_validate(request.scope[PARSED])
        text = bytes(llm.detokenize(body.tokens)).decode("utf-8", errors="replace")
        return JSONResponse({"text": text})

    app.add_route("/metrics", metrics_endpoint, methods=["GET"])
    app.router.routes.insert(0, StarletteRoute("/extras/detokenize", detokenize, methods=["POST"]))
    if names is not None:
        app.router.routes.insert(
            0, StarletteRoute("/v1/models", models_list(names), methods=["GET"])
        )
    app.add_middleware(OpenAIFields, is_eog=eog_check(llm))
    routes = openai_routes(requests)
    # the API docs go; the rest the guard lets through by path (FastAPI keeps an included
    # router as one object, so llama-cpp-python's embeddings route stays mounted, unreachable)
    app.router.routes[:] = [
        r for r in app.router.routes if getattr(r, "path", None) in (None, *routes)
    ]
    app.add_middleware(
        OpenAIErrors,
        requests={
            "/v1/completions": CreateCompletionRequest,
            "/v1/engines/copilot-codex/completions": CreateCompletionRequest,
            "/v1/chat/completions": CreateChatCompletionRequest,
        },
        describe=describe,
    )
    app.add_middleware(
        Guard, routes=routes, shapes=shapes or Shapes(), counts=counts, max_body=max_body
    )
    return routes


def eog_check(llm: Any) -> Any:
    """Whether a token ends a turn (llama.cpp's end-of-generation tokens)."""
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    return lambda token: bool(llama_cpp.llama_vocab_is_eog(vocab, token))


def pages(paths: list[str]) -> dict[str, Route]:
    """Routes that only answer GET (pages, and what they read)."""
    return {p: Route(p, frozenset({"GET"})) for p in paths}


def openai_routes(requests: BodyChecks) -> dict[str, Route]:
    """Every route the server answers, with the check of its body (``validate``)."""
    post = frozenset({"POST"})
    get = frozenset({"GET"})
    budget = token_budget
    table = [
        Route("/v1/completions", post, requests.completion, counted=True, budget=budget),
        Route(
            "/v1/engines/copilot-codex/completions",
            post,
            requests.completion,
            counted=True,
            budget=budget,
        ),
        Route("/v1/chat/completions", post, requests.chat, counted=True, budget=budget),
        Route("/v1/models", get),
        Route("/extras/tokenize", post, requests.tokenize),
        Route("/extras/tokenize/count", post, requests.tokenize),
        Route("/extras/detokenize", post, requests.detokenize),
        Route("/metrics", get),
    ]
    return {r.path: r for r in table}
