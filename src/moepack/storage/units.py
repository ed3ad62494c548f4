"""Byte sizes as people write them: ``64K``, ``1MiB``, ``2G``, ``4096``."""

from __future__ import annotations

import re
from fractions import Fraction

from ..errors import BadInput

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536. Binary units (K = KiB); a bare number is bytes."""
    m = _RE.match(text)
    if not m:
        raise BadInput(f"not a size: {text!r} (write e.g. 4096, 64K, 1M, 2GiB)")
    value = Fraction(m.group(1)) * _UNITS[m.group(2).lower()]  # exact: no float rounding
    if value.denominator != 1 or value < 1:
        raise BadInput(f"not a whole positive number of bytes: {text!r}")
    return int(value)


def format_size(n: int) -> str:
    """65536 -> ``64K``; the inverse of ``parse_size`` for whole units."""
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)
