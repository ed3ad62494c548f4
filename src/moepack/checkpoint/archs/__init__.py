"""Synthetic MoE architectures, one module per family (``PLUGIN = …``), found through the one
registry helper. ``moepack synth --arch NAME`` takes any name listed by ``arch_names()``."""

from __future__ import annotations

from ...registry import Registry
from ._base import F32_ROLES, SynthArch, TensorPlan

ARCHS: Registry[SynthArch] = Registry("architecture", __name__, base=SynthArch)


def get_arch(name: str) -> SynthArch:
    """The architecture called ``name``; ``BadInput`` listing the known ones otherwise."""
    return ARCHS.get(name)


def arch_names() -> list[str]:
    return ARCHS.names()


__all__ = ["ARCHS", "F32_ROLES", "SynthArch", "TensorPlan", "arch_names", "get_arch"]
