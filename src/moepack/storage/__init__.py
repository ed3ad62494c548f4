"""Storage: read engines, cache control, the bandwidth surface, and the kio comparison.

Central types: ``ReadEngine`` (one per module under ``engines/``, in a registry) and
``Surface`` (``Surface.bandwidth(request_bytes, queue_depth)`` for the layout planner).
"""

from __future__ import annotations

from .engine import ReadEngine, all_engines, get_engine
from .kio import KioReport, run_kio
from .modes import Mode, ModeUnsupported, OpenFile, open_file
from .probe import ProbeResult, run_probe
from .reader import ReadOutcome, read_ranges
from .surface import Surface, SurfaceCell

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
