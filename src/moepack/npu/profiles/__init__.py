"""Profile registry: every module in this package whose ``PLUGIN`` is a ``LayoutProfile``.

Adding a runtime layout is adding a file here; nothing else changes. The default profile's
module has the lowest ``ORDER``, so it is listed first (``moepack.registry``).
"""

from __future__ import annotations

from ...registry import Registry
from ..profile import LayoutProfile

DEFAULT = "flm-0.9.46"

PROFILES: Registry[LayoutProfile] = Registry(
    "profile", __name__, base=LayoutProfile, every_module=True
)


def all_profiles() -> list[LayoutProfile]:
    """Profiles, the default first."""
    return PROFILES.all()


def get_profile(name: str | None) -> LayoutProfile:
    """The profile called ``name`` or one of its aliases (``None``: the default)."""
    return PROFILES.get(name or DEFAULT)
