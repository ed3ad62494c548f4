"""``probe --out [--png]``: measure a surface and write it, and its heatmap when asked for, as
one group (both appear or neither). The destinations are checked before any measuring."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import BadInput
from ..filekinds import IMAGE, SURFACE, check_output_kind
from ..outputs import write_together
from ..safeio import check_destination, real
from .probe import ProbeResult, probe_inputs, run_probe
from .surface import FORMAT_NAME


def probe_to_files(
    target: Path,
    out: Path | None = None,
    fmt: str = FORMAT_NAME,
    png: Path | None = None,
    **probe: Any,
) -> ProbeResult:
    """``run_probe(target, **probe)``, then the surface to ``out`` in ``fmt`` and its heatmap
    to ``png`` (either may be ``None``); ``result.written`` lists what was written."""
    inputs = probe_inputs(target)  # the probed file, or the corpus a folder holds
    for dest, kind in ((out, SURFACE), (png, IMAGE)):
        if dest is not None:
            check_destination(dest, inputs)
            check_output_kind(dest, kind)
    if out is not None and png is not None and real(out) == real(png):
        raise BadInput("`out` and `png` name the same file", out)
    result = run_probe(target, **probe)
    files = []
    if out is not None:
        files.append((out, result.surface.encode(fmt)))
    if png is not None:
        from .heatmap import heatmap_png

        files.append((png, heatmap_png(result.surface)))
    result.written = [str(p) for p in write_together(files, [result.target])]
    return result
