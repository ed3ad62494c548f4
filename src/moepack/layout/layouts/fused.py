"""``fused``: gate and up as one slice per expert, as llama.cpp's ``ffn_gate_up_exps`` holds them."""

from __future__ import annotations

from dataclasses import replace

from ..layout import Layout, LayoutSpec

ORDER = 40


class Fused(Layout):
    """One read instead of two for the two matrices every chosen expert needs first."""

    name = "fused"
    summary = "gate and up fused into one slice per expert"
    aliases = ("gate-up",)

    def apply(self, spec: LayoutSpec) -> LayoutSpec:
        return replace(spec, fuse_gate_up=True)


PLUGIN = Fused()
