"""llama.cpp (through llama-cpp-python): capture, check-dropin, run with the expert prefetcher,
and ``prefetching(llm)``, the prefetcher on a ``llama_cpp.Llama`` of the caller's own
(``capturing(llm)``: its routing alone); ``streaming_llama(path)`` (or ``Llama(...)`` inside
``llama_placement(path)``) loads one whose experts stay in the file's mapping;
``drafting(llm, DraftOptions(...))`` gives it drafts verified a pass at a time.

Four sub-packages, lowest first (``docs/architecture.md``): ``protocol`` (the worker protocol),
``prefetcher`` (what runs inside llama.cpp's process), ``runtime`` (the entry points) and
``judge`` (check-dropin and the judge)."""

from __future__ import annotations

from typing import Any

__all__ = [
    "prefetching",
    "capturing",
    "PrefetchHook",
    "RouteHook",
    "StreamOptions",
    "streaming_llama",
    "llama_placement",
    "drafting",
    "DraftHook",
    "DraftOptions",
]

_HOOK_NAMES = ("prefetching", "capturing", "PrefetchHook", "RouteHook")


def __getattr__(name: str) -> Any:
    """The public names, imported on first use (importing the package stays cheap)."""
    if name in _HOOK_NAMES:
        from .runtime import hook

        return getattr(hook, name)
    if name in ("streaming_llama", "llama_placement"):
        from .runtime import placement

        return getattr(placement, name)
    if name in ("drafting", "DraftHook"):
        from .runtime import draft_hook

        return getattr(draft_hook, name)
    if name == "DraftOptions":
        from .runtime.draft import DraftOptions

        return DraftOptions
    if name == "StreamOptions":
        from .prefetcher.streamer import StreamOptions

        return StreamOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The lazy public names too, so ``dir()`` and completion show them."""
    return sorted({*globals(), *__all__})
