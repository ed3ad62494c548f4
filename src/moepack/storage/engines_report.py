"""``engines``: which read engines exist, which modes a path's filesystem serves, and which
io_uring bindings work here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..jsonable import to_jsonable
from .engine import all_engines
from .modes import Mode
from .support import mode_support


@dataclass
class EnginesReport:
    """Per engine its modes, depth limit and why it cannot run (``None``: it can)."""

    engines: list[dict[str, Any]]
    modes: dict[str, Any] | None = None
    dio_align: dict[str, Any] | None = None
    bindings: list[dict[str, Any]] | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"engines": self.engines}
        if self.modes is not None:
            doc["modes"] = self.modes
        if self.dio_align is not None:
            doc["dio_align"] = self.dio_align
        if self.bindings is not None:
            doc["bindings"] = self.bindings
        return doc


def engines_report(path: Path | None = None, bindings: bool = True) -> EnginesReport:
    """Every registered engine; with ``path``, the modes its filesystem serves; with
    ``bindings``, each io_uring binding tried in a subprocess."""
    report = EnginesReport(
        engines=[
            {
                "name": e.name,
                "summary": e.summary,
                "modes": [m.value for m in Mode if m in e.modes],
                "max_depth": e.max_depth,
                "unavailable": e.unavailable_reason(),
            }
            for e in all_engines().values()
        ]
    )
    if path is not None:
        support = mode_support(path)
        report.modes = {
            "file": support.file,
            "unsupported": support.unsupported,
            "untested": support.untested,
        }
        if support.dio_align:
            a = support.dio_align
            report.dio_align = {"mem": a.mem, "offset": a.offset, "source": a.source}
    if bindings:
        from .uring.bindings import check_bindings

        report.bindings = [to_jsonable(b) for b in check_bindings()]
    return report
