"""``reorder``: a plan's permutation of each block's experts (slot ``s`` holds ``perm[s]``)."""

from __future__ import annotations

from dataclasses import replace

from ..layout import Layout, LayoutSpec

ORDER = 20


class Reorder(Layout):
    """Experts that fire together placed next to each other, so their reads merge."""

    name = "reorder"
    summary = "experts permuted by a plan, tensors where they are"
    aliases = ("reordered",)

    def apply(self, spec: LayoutSpec) -> LayoutSpec:
        return replace(spec, permute=True)


PLUGIN = Reorder()
