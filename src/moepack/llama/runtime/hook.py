"""The prefetcher on a ``llama_cpp.Llama`` of the caller's own: one call.

``moepack run`` starts its own llama.cpp; a user of llama-cpp-python (a chat application, the
llama-cpp-python server, a notebook) has a ``Llama`` already. ``prefetching(llm)`` gives that
object the expert prefetcher without changing its API (chat templates,
``create_chat_completion``, streaming, grammars all go through it as before):

- the ``Llama`` made its context in its constructor, where no eval callback can be set, so
  the hook makes a new context with the same parameters and the prefetcher's callback (the C
  gate) and puts it in place of the old one, which is closed; the KV cache starts empty, as
  after ``llm.reset()``, which the hook survives (it changes no context);
- every ``llama_decode`` of that context tells the prefetcher a pass starts and ends (the
  callback is switched off while the whole file is cached, so a cached model costs nothing);
- ``detach()`` (or leaving a ``with`` block) switches the callback off and stops the
  prefetcher's thread; the context stays, and with it the KV cache, the callback answering
  every question "no" from C (``EvalCallback.enabled``) for the rest of its life;
- a ``Llama`` whose experts llama.cpp copied out of the file's mapping at load (its repacked
  layouts: the default for Q4_0 and Q4_K on x86) is refused in one line saying how to load
  it (``streaming_llama(path)``, or ``Llama(...)`` inside ``llama_placement(path)``);
- a ``Llama`` whose context was made again (``llm.__setstate__`` after a pickle, code of the
  caller's own) has lost the hook: ``prefetching`` on it again attaches a new one.

``on_route(block, ids)`` receives every MoE layer's top-k (``[tokens, k]``) as llama.cpp
computes it: routing capture while serving; ``capturing(llm, on_route)`` does the same
without the prefetcher (one graph split per MoE layer, as ``run --trace`` without it). llama.cpp computes the last layer only for the
tokens whose logits are asked for, so a complete capture of prompts needs a ``Llama`` made with
``logits_all=True``.

llama-cpp-python's own thread handling is kept (no ggml thread pool is attached: in its
OpenMP build, the one pip compiles, each graph split reuses OpenMP's threads). OpenMP reads
its wait policy as it loads, before any hook can run: a process that prefetches
a model larger than its memory should start with ``GOMP_SPINCOUNT`` low (``moepack serve``
does; ``run.PRESSURE_SPIN``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from ...errors import BadInput
from ..prefetcher.evalcb import EvalCallback
from ..prefetcher.mapping import file_mappings, no_readaround
from ..prefetcher.streamer import TOPK, ExpertStreamer, StreamOptions
from .weights import WeightReport, expert_names, probe

RouteHandler = Callable[[int, np.ndarray], None]


def _hooked_context(
    llm: Any, callback: EvalCallback, before: Callable[[], None], after: Callable[[], None]
) -> Any:
    """Put a context with ``callback`` in place of ``llm``'s own (closed), with ``before`` and
    ``after`` told around every ``llama_decode``; the new context, which holds no tokens."""
    from llama_cpp import _internals

    params = llm.context_params
    callback.install(params)

    class HookedContext(_internals.LlamaContext):
        """llama-cpp-python's context, telling the hook where passes start and end."""

        def decode(self, batch: Any) -> None:
            before()
            try:
                super().decode(batch)
            finally:
                after()

    old = llm._ctx
    ctx = HookedContext(model=llm._model, params=params, verbose=llm.verbose)
    llm._ctx = ctx
    old.close()
    llm._stack.callback(ctx.close)
    llm.n_tokens = 0  # a new context holds no tokens
    # the context keeps calling the gate until it is freed: so must its objects live
    kept = getattr(llm, "_moepack_callbacks", [])
    kept.append(callback)
    llm._moepack_callbacks = kept
    return ctx


def check_experts_mapped(llm: Any, path: str) -> list[str]:
    """``BadInput`` in one line, saying how to load it, when llama.cpp copied expert tensors
    out of the file's mapping at load (its repacked layouts, the default for Q4_0 and Q4_K
    on x86): the prefetcher would read pages nothing computes from. Returns the (dense)
    weights it did copy out."""
    experts, shards = expert_names(path)
    sites = probe(llm._model.model, shards)
    unmapped = WeightReport({}, sites, experts, None).experts_unmapped
    if unmapped:
        raise BadInput(
            f"llama.cpp copied {len(unmapped)} expert tensors out of the file's mapping at load "
            f"({unmapped[0]}, …: its repacked layouts), so there is nothing to prefetch: build "
            "the Llama with moepack.llama.streaming_llama(path, …) or inside "
            "`with moepack.llama.llama_placement(path):`",
            path,
        )
    return [name for name, site in sites.items() if not site.mapped]


class PrefetchHook:
    """The prefetcher attached to one ``Llama`` (``prefetching`` makes it)."""

    def __init__(
        self,
        llm: Any,
        options: StreamOptions | None = None,
        *,
        readaround: bool = False,
        on_route: RouteHandler | None = None,
        warn: Callable[[str], None] | None = None,
        lookahead_ids: np.ndarray | None = None,
    ) -> None:
        path = getattr(llm, "model_path", None)
        if not path or not os.path.isfile(path):
            raise BadInput("this Llama has no model file to prefetch from (model_path)")
        if not file_mappings(Path(path)):  # llama.cpp read it into memory (use_mmap=False)
            raise BadInput("the model is not memory-mapped here: nothing to prefetch", path)
        copied = check_experts_mapped(llm, path)
        self.llm = llm
        self.streamer = ExpertStreamer(
            path, options or StreamOptions(), lookahead_ids=lookahead_ids, warn=warn
        )
        self.streamer.on_choice = on_route
        self.capturing = on_route is not None  # every pass is seen: the callback stays on
        self.ctx = _hooked_context(llm, self.streamer.callback, self.before_pass, self.after_pass)
        self.readaround_bytes = 0
        if not readaround:
            self.readaround_bytes = no_readaround(self.streamer.paths, self.streamer.expert_ranges)
        params = llm.context_params
        self.streamer.attach(threads=max(params.n_threads, params.n_threads_batch), copied=copied)
        self.attached = True
        llm._moepack_hook = self
        # closing the Llama runs its stack last-in first: the pager lets go of the experts
        # before the context and the model (whose mapping it holds) are freed
        llm._stack.callback(self.detach)

    def before_pass(self) -> None:
        if self.attached and not self.capturing:
            self.streamer.before_pass()

    def after_pass(self) -> None:
        if self.attached:
            self.streamer.after_pass()

    def cold_start(self) -> None:
        """The caller dropped the model's pages: ask at the next pass whether it is cached
        (the callback stays off for 16 passes after the whole file was found cached)."""
        self.streamer.cold_start()

    @property
    def current(self) -> bool:
        """Whether the ``Llama`` still computes with the context this hook made."""
        return self.llm._ctx is self.ctx

    def snapshot(self) -> dict[str, float]:
        """The prefetcher's counters so far (subtract two for a span of work)."""
        return self.streamer.snapshot()

    def report(self) -> dict[str, Any]:
        """Mode, pins, cache, lookahead record (``run``'s ``stream`` section)."""
        return self.streamer.report()

    def detach(self) -> None:
        """Switch the callback off and stop the prefetcher (idempotent)."""
        if not self.attached:
            return
        self.attached = False
        self.streamer.callback.enabled = False
        self.streamer.close()

    def __enter__(self) -> PrefetchHook:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.detach()


def prefetching(
    llm: Any,
    options: StreamOptions | None = None,
    *,
    readaround: bool = False,
    on_route: RouteHandler | None = None,
    warn: Callable[[str], None] | None = None,
    lookahead_ids: np.ndarray | None = None,
) -> PrefetchHook:
    """Attach the expert prefetcher to ``llm`` (a ``llama_cpp.Llama``) and return the hook.

    A ``Llama`` that already has a current hook gets it back (its options unchanged); one
    whose hook was detached, or whose context was made again since, gets a new one.
    ``readaround``: keep the kernel's fault read-around on the expert ranges (off by default:
    the prefetcher's own reads are already in flight). ``lookahead_ids``: a trace's ids
    ``[tokens, layers, k]`` to fit the trace-learned lookahead predictors on."""
    old: PrefetchHook | None = getattr(llm, "_moepack_hook", None)
    if old is not None and old.attached and old.current:
        return old
    if old is not None:
        old.detach()
    return PrefetchHook(
        llm,
        options,
        readaround=readaround,
        on_route=on_route,
        warn=warn,
        lookahead_ids=lookahead_ids,
    )


class RouteHook:
    """Routing capture alone on a ``Llama`` (no prefetcher): ``capturing`` makes it."""

    def __init__(self, llm: Any, on_route: RouteHandler) -> None:
        self.llm = llm
        self.callback = EvalCallback([TOPK], lambda _name, block, ids: on_route(block, ids))
        self.ctx = _hooked_context(llm, self.callback, _nothing, self.callback.raise_pending)
        self.attached = True

    @property
    def current(self) -> bool:
        """Whether the ``Llama`` still computes with the context this hook made."""
        return self.llm._ctx is self.ctx

    def detach(self) -> None:
        """Switch the callback off (the context stays; idempotent)."""
        self.attached = False
        self.callback.enabled = False


def _nothing() -> None:
    return None


def capturing(llm: Any, on_route: RouteHandler) -> RouteHook:
    """Tell ``on_route(block, ids)`` every MoE layer's top-k as ``llm`` computes it, without
    the prefetcher (with it: ``prefetching(llm, on_route=...)``). The context is made again,
    as ``prefetching`` makes it; for the last layer of every prompt token, make the ``Llama``
    with ``logits_all=True``."""
    hook: PrefetchHook | None = getattr(llm, "_moepack_hook", None)
    if hook is not None and hook.attached and hook.current:
        raise BadInput("this Llama has the prefetcher: pass `on_route` to prefetching instead")
    return RouteHook(llm, on_route)
