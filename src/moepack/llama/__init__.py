"""llama.cpp (through llama-cpp-python): capture, check-dropin, run with the expert prefetcher,
and ``prefetching(llm)``, the prefetcher on a ``llama_cpp.Llama`` of the caller's own
(``capturing(llm)``: its routing alone)."""

from __future__ import annotations

from typing import Any

__all__ = ["prefetching", "capturing", "PrefetchHook", "RouteHook", "StreamOptions"]


def __getattr__(name: str) -> Any:
    """The public names, imported on first use (importing the package stays cheap)."""
    if name in ("prefetching", "capturing", "PrefetchHook", "RouteHook"):
        from . import hook

        return getattr(hook, name)
    if name == "StreamOptions":
        from .streamer import StreamOptions

        return StreamOptions
    raise AttributeError(name)
