"""Storage: read engines, cache control, the bandwidth surface, and the kio comparison.

Central types: ``ReadEngine`` (one per module under ``engines/``, in a registry) and
``Surface`` (``Surface.bandwidth(request_bytes, queue_depth)`` for the layout planner).

The names below are imported from their modules on first use: importing one light module of
the package (``storage.units``, ``storage.engines_report``) must not import the measuring ones
and numpy with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import ReadEngine, all_engines, get_engine
    from .kio import KioReport, run_kio
    from .modes import Mode, ModeUnsupported, OpenFile, open_file
    from .probe import ProbeResult, run_probe
    from .reader import ReadOutcome, read_ranges
    from .surface import Surface, SurfaceCell

_HOME = {
    "ReadEngine": "engine",
    "all_engines": "engine",
    "get_engine": "engine",
    "KioReport": "kio",
    "run_kio": "kio",
    "Mode": "modes",
    "ModeUnsupported": "modes",
    "OpenFile": "modes",
    "open_file": "modes",
    "ProbeResult": "probe",
    "run_probe": "probe",
    "ReadOutcome": "reader",
    "read_ranges": "reader",
    "Surface": "surface",
    "SurfaceCell": "surface",
}

__all__ = [
    "KioReport",
    "Mode",
    "ModeUnsupported",
    "OpenFile",
    "ProbeResult",
    "ReadEngine",
    "ReadOutcome",
    "Surface",
    "SurfaceCell",
    "all_engines",
    "get_engine",
    "open_file",
    "read_ranges",
    "run_kio",
    "run_probe",
]


def __getattr__(name: str) -> Any:
    """``from moepack.storage import Mode``: the name from its module, imported now."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
