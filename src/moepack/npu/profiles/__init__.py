"""Profile registry: every module in this package that defines ``PROFILE`` is a profile.

Adding a runtime layout is adding a file here; nothing else changes.
"""

from __future__ import annotations

import importlib
import pkgutil

from ...errors import BadInput
from ..profile import LayoutProfile

DEFAULT = "flm-0.9.46"
_REGISTRY: dict[str, LayoutProfile] | None = None


def _load() -> dict[str, LayoutProfile]:
    global _REGISTRY
    if _REGISTRY is None:
        found: dict[str, LayoutProfile] = {}
        for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
            mod = importlib.import_module(f"{__name__}.{info.name}")
            prof = getattr(mod, "PROFILE", None)
            if isinstance(prof, LayoutProfile):
                found[prof.name] = prof
        _REGISTRY = found
    return _REGISTRY


def all_profiles() -> list[LayoutProfile]:
    """Profiles, the default first."""
    profs = list(_load().values())
    return sorted(profs, key=lambda p: (p.name != DEFAULT, p.name))


def get_profile(name: str | None) -> LayoutProfile:
    name = name or DEFAULT
    reg = _load()
    if name in reg:
        return reg[name]
    for prof in reg.values():
        if name in prof.aliases:
            return prof
    known = ", ".join(p.name for p in all_profiles())
    raise BadInput(f"unknown profile {name!r}; known profiles: {known}")
