"""CLI for ``moepack serve``: llama-cpp-python's OpenAI-compatible server with the prefetcher."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from ..llama.runtime.choice import Prefetch
from ..llama.runtime.draft import DraftOptions
from ..serve.requestlog import line as request_line
from ..serve.server import (
    MAX_BODY,
    TRACE_MAX_BYTES,
    Listening,
    ServeOptions,
    serve_model,
)
from .draft import draft_options
from .options import (
    SizeType,
    batch_option,
    file_path,
    force_option,
    input_path,
    json_option,
    threads_batch_option,
    threads_option,
)
from .prefetch import prefetch_options
from .render import notes, stdout, warn


@click.command("serve")
@click.argument("model", type=input_path)
@prefetch_options
@draft_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8000,
    show_default=True,
    help="Port to listen on (0: one the system picks; the line printed says which).",
)
@click.option(
    "--alias",
    "aliases",
    multiple=True,
    help="A name the model answers to in the API (default: the file's name without .gguf); "
    "repeatable, and globs are patterns (--alias 'claude-*', --alias '*' for any name). The "
    "model lists show the plain names; a request naming none of them is answered 404.",
)
@click.option(
    "--chat-format",
    help="llama-cpp-python's chat format (default: the model's own chat template).",
)
@click.option(
    "--ctx",
    "--n-ctx",
    "n_ctx",
    type=click.IntRange(min=8),
    default=4096,
    show_default=True,
    help="Context length (tokens) of the llama.cpp context.",
)
@threads_option(None)
@threads_batch_option
@batch_option
@click.option(
    "--spin",
    type=click.IntRange(min=0),
    default=None,
    help="How long ggml's OpenMP threads spin-wait before they sleep (GOMP_SPINCOUNT; "
    "default: 10000 when prefetching a model larger than memory, OpenMP's own otherwise).",
)
@click.option(
    "--trace-out",
    type=file_path,
    help="Capture the routing of every request into this trace (.moetrace, .pmxtrace, …), one "
    "prompt segment per request, written when the server stops. Tracing makes the model with "
    "logits_all=True (llama.cpp computes the last layer only for the tokens whose logits are "
    "asked for), which costs prefill time and a context x vocabulary array of floats in "
    "memory; it also makes logprobs available.",
)
@click.option(
    "--trace-max-bytes",
    type=SizeType(),
    default=str(TRACE_MAX_BYTES),
    show_default="1G",
    help="The most the trace may hold; once reached, later requests are not traced (said once).",
)
@click.option(
    "--trace-text",
    is_flag=True,
    help="Also keep each request's prompt and generated text in the trace (never kept otherwise).",
)
@click.option(
    "--watch-routing",
    is_flag=True,
    help="Capture every layer's routing for the dashboard's heat map (at /; always on with "
    "--trace-out). Costs a Python call per MoE layer and pass, and keeps the prefetcher's "
    "callback on when the whole model is cached.",
)
@click.option(
    "--api-key",
    envvar="MOEPACK_API_KEY",
    help="Require this key of every API request, OpenAI's (Authorization: Bearer KEY) and "
    "Anthropic's (x-api-key: KEY) alike; the dashboard and /metrics stay open. Default: "
    "$MOEPACK_API_KEY, else none.",
)
@click.option(
    "--log-json",
    is_flag=True,
    help="Log each answered request on stderr as one JSON object (default: one line of text).",
)
@click.option(
    "--max-body",
    type=SizeType(),
    default=str(MAX_BODY),
    show_default="8M",
    help="The largest request body taken; a larger one is answered 413 before it is read.",
)
@click.option(
    "--max-prompt-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="The most tokens a prompt may have (default: the context); a prompt whose size "
    "alone shows it longer is answered 413 before it is tokenised.",
)
@click.option(
    "--max-queue",
    type=click.IntRange(min=0),
    default=None,
    help="How many requests may wait for the model while one runs; the next is answered 429 "
    "(rate limited, Retry-After) at once. Default: no limit.",
)
@click.option(
    "--prefix-cache",
    type=SizeType(zero=True),
    default=None,
    show_default="2G, or an eighth of the run's memory where that is less",
    help="Memory for the KV state of recent prompts, kept across requests: a conversation "
    "another request came between (an agent's side request, a second user) restores its "
    "longest cached prefix instead of computing the whole prompt again; counted in the "
    "run's memory. 0: off.",
)
@force_option
@json_option
def serve_cmd(
    model: Path,
    prefetch: Prefetch,
    memory: int | str,
    lookahead_trace: Path | None,
    draft: DraftOptions,
    placement: str,
    host: str,
    port: int,
    aliases: tuple[str, ...],
    chat_format: str | None,
    n_ctx: int,
    threads: int | None,
    threads_batch: int | None,
    batch: int,
    spin: int | None,
    trace_out: Path | None,
    trace_max_bytes: int,
    trace_text: bool,
    watch_routing: bool,
    api_key: str | None,
    log_json: bool,
    max_body: int,
    max_prompt_tokens: int | None,
    max_queue: int | None,
    prefix_cache: int | None,
    as_json: bool,
) -> None:
    """Serve MODEL over an OpenAI-compatible API (/v1/chat/completions, /v1/completions,
    /v1/models: llama-cpp-python's server) with the optional expert prefetcher, its
    measurements at /metrics (Prometheus) and a live dashboard at /; one line per answered
    request on stderr. Ctrl-C or SIGTERM stops it within seconds: the generation in
    progress ends at its next token and is answered, requests waiting are refused (503);
    a second one stops it at once."""
    options = ServeOptions(
        host=host,
        port=port,
        aliases=aliases,
        chat_format=chat_format,
        n_ctx=n_ctx,
        threads=threads,
        threads_batch=threads_batch,
        batch=batch,
        prefetch=prefetch,
        memory=memory,
        spin=spin,
        trace_max_bytes=trace_max_bytes,
        trace_text=trace_text,
        lookahead_trace=str(lookahead_trace) if lookahead_trace else None,
        watch_routing=watch_routing,
        placement=placement,
        max_body=max_body,
        max_prompt_tokens=max_prompt_tokens,
        max_queue=max_queue,
        api_key=api_key or None,
        draft=draft,
        prefix_cache=prefix_cache,
    )

    def show(where: Listening) -> None:
        if as_json:
            sys.stdout.write(json.dumps(where.to_json()) + "\n")
            sys.stdout.flush()
            return
        how = {
            "llama.cpp": "llama.cpp's own mmap reads",
            "pager": "experts paged by moepack",
            "page cache": "experts prefetched through the page cache",
        }.get(where.engine, where.engine)
        stdout.print(
            f"serving {model.name} as {where.alias!r} at {where.url} ({how}; dashboard at "
            f"{where.url.removesuffix('/v1')}/, metrics at {where.url.removesuffix('/v1')}/metrics)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )

    serve_model(
        model,
        options,
        trace_out=trace_out,
        on_listening=show,
        on_warning=lambda message: warn([message]),
        on_request=lambda summary: _log(summary, log_json),
        on_note=lambda message: notes([message]),
    )


def _log(summary: dict[str, Any], as_json: bool) -> None:
    """One answered request on stderr."""
    text = json.dumps(summary) if as_json else request_line(summary)
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
