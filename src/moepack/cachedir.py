"""The user's cache directory for what moepack measures or builds once and reuses.

``$MOEPACK_CACHE_DIR``, else ``$XDG_CACHE_HOME/moepack``, else ``~/.cache/moepack``: the
prefetcher's compiled C (``c/``), ``fit``'s storage measurements and calibrations
(``fit/``), the llama-cpp-python wheels built for this CPU (``llama-wheels/``). One helper so
every user of the cache agrees on where it is.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where moepack keeps what it builds or measures once: ``MOEPACK_CACHE_DIR``, else the
    XDG cache directory."""
    if os.environ.get("MOEPACK_CACHE_DIR"):
        return Path(os.environ["MOEPACK_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "moepack"
