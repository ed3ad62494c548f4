"""The expert prefetcher's flags, shared by ``run`` and ``serve`` (one set of flags, one
``StreamOptions`` from them)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

from ..llama.prefetcher.pager import PAGER_CHOICES
from ..llama.prefetcher.streamer import MODES, PIN_CHOICES, StreamOptions
from ..llama.runtime.choice import AutoStream, Prefetch
from ..llama.runtime.placement import CHOICES as PLACEMENTS
from .options import SizeType, engine_options, file_path

FLAGS = (
    "prefetch_mode",
    "lookahead",
    "lookahead_budget",
    "lookahead_depth",
    "pin_dense",
    "cache",
    "pager",
    "engine",
    "queue_depth",
)
"""The parameters the flags fill, folded into ``prefetch`` before the command runs."""


def prefetch_options(f: Callable[..., None]) -> Callable[..., None]:
    """The expert prefetcher's options (``run`` and ``serve``): the command takes them as one
    ``prefetch: Prefetch`` (``stream_options``), ``memory`` (what the whole run may take),
    ``lookahead_trace`` and
    ``placement`` (where llama.cpp keeps the weights, with or without the prefetcher)."""

    @functools.wraps(f)
    def folded(*args: Any, **kwargs: Any) -> None:
        flags = {k: kwargs.pop(k) for k in FLAGS}
        kwargs["prefetch"] = stream_options(kwargs["prefetch"], **flags)
        f(*args, **kwargs)

    for opt in reversed(
        [
            click.option(
                "--prefetch/--no-prefetch",
                default=None,
                help="Read each layer's chosen experts while its matmuls run (and guess the "
                "next layers'); --no-prefetch: llama.cpp's own mmap. Default: the prefetcher "
                "with the pager where the model does not fit in the memory available (one "
                "line says so), llama.cpp's defaults where it does.",
            ),
            click.option(
                "--prefetch-mode",
                type=click.Choice(MODES),
                default="overlap",
                show_default=True,
                help="overlap: reads run beside llama.cpp's compute; serial: each layer waits "
                "for its reads (with --engine at --qd).",
            ),
            click.option(
                "--lookahead",
                default="router",
                show_default=True,
                help="Predictors of the next layers' experts: router, cross-layer, markov, "
                "sticky, frequency, joined with +; none.",
            ),
            click.option(
                "--lookahead-budget",
                type=click.IntRange(0, 4096),
                default=0,
                help="Experts per token and layer read ahead at most (0: the model's top-k); "
                "fewer while the predictions miss.",
            ),
            click.option(
                "--lookahead-depth",
                type=click.IntRange(1, 4),
                default=1,
                show_default=True,
                help="Layers ahead to read for.",
            ),
            click.option(
                "--lookahead-trace",
                type=file_path,
                help="Fit the trace-learned predictors on this trace (else they learn online).",
            ),
            click.option(
                "--pin-dense",
                type=click.Choice(PIN_CHOICES),
                default="auto",
                show_default=True,
                help="Lock the dense weights (attention, norms, routers, embeddings) in "
                "memory; auto: when the model does not fit in the memory available.",
            ),
            click.option(
                "--cache",
                "cache",
                type=CacheChoice(),
                default="auto",
                show_default=True,
                help="The live expert cache: a byte budget (an LRU per layer of its share, "
                "what replay --policy lru models), auto (the memory available, when the model "
                "does not fit), or kernel (no cache of moepack's).",
            ),
            click.option(
                "--memory",
                type=MemoryChoice(),
                default="auto",
                show_default=True,
                help="Memory the run may take: the dense weights, the context (KV cache and "
                "compute buffers, as llama.cpp counts them), the prefix cache and, of what is "
                "left, the experts (a hard bound with the pager; the live cache's budget "
                "without it); auto: the memory available now, less a margin. Too little for "
                "the context is refused before loading, naming the context that fits.",
            ),
            click.option(
                "--pager",
                type=click.Choice(PAGER_CHOICES),
                default="auto",
                show_default=True,
                help="The experts in memory moepack owns (userfaultfd, O_DIRECT reads, "
                "--memory a hard bound); auto: where the model does not fit in --memory (or, "
                "with --memory auto, in the memory available) and userfaultfd works here (else "
                "one warning, and the page cache); on: refuse to run without it; off: the "
                "page cache.",
            ),
            engine_options(
                "Read engine of --prefetch-mode serial.", "Its queue depth (and the pager's)."
            ),
            click.option(
                "--placement",
                type=click.Choice(PLACEMENTS),
                default="auto",
                show_default=True,
                help="Where llama.cpp keeps the weights: defaults (its own: Q4_0/Q4_K "
                "repacked into memory at load), experts-mapped (routed experts left in the "
                "file's mapping, dense weights repacked), mapped (nothing repacked); auto: "
                "experts-mapped when prefetching or when the model does not fit, else defaults.",
            ),
        ]
    ):
        folded = opt(folded)
    return folded


class CacheChoice(click.ParamType):
    """``auto``, ``kernel``, or a byte count (``1.5G``)."""

    name = "SIZE|auto|kernel"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> str | int:
        if isinstance(value, int) or value in ("auto", "kernel"):
            return value
        return int(SizeType().convert(value, param, ctx))


class MemoryChoice(click.ParamType):
    """``auto`` or a byte count (``6G``)."""

    name = "SIZE|auto"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> str | int:
        if isinstance(value, int) or value == "auto":
            return value
        return int(SizeType().convert(value, param, ctx))


def stream_options(
    prefetch: bool | None,
    *,
    prefetch_mode: str,
    lookahead: str,
    lookahead_budget: int,
    lookahead_depth: int,
    pin_dense: str,
    cache: str | int,
    pager: str,
    engine: str,
    queue_depth: int,
) -> Prefetch:
    """The prefetch options as the library takes them: ``StreamOptions`` with ``--prefetch``,
    None with ``--no-prefetch``, ``AutoStream`` (the prefetcher where the model does not fit)
    with neither."""
    if prefetch is False:
        return None
    options = StreamOptions(
        mode=prefetch_mode,
        engine=engine,
        queue_depth=queue_depth,
        lookahead=lookahead,
        lookahead_budget=lookahead_budget,
        lookahead_depth=lookahead_depth,
        pin_dense=pin_dense,
        cache=cache,
        pager=pager,
    )
    return options if prefetch else AutoStream(options)
