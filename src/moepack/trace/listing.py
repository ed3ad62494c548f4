"""``trace formats``: what each registered trace format reads and writes."""

from __future__ import annotations

from dataclasses import dataclass

from .formats import FORMATS


@dataclass
class FormatRow:
    """One trace format: its name, file extensions, writable versions and what it is."""

    name: str
    extensions: list[str]
    versions: list[int]
    description: str


def list_formats() -> list[FormatRow]:
    """Every registered trace format, in the registry's order."""
    return [
        FormatRow(m.NAME, list(m.EXTENSIONS), list(m.VERSIONS), m.DESCRIPTION)
        for m in FORMATS.values()
    ]
