"""``expert-major``: all of an expert's slices adjacent, expert after expert (an expert store)."""

from __future__ import annotations

from ..layout import Layout, LayoutSpec, with_arrangement

ORDER = 50


class ExpertMajor(Layout):
    """One contiguous run per chosen expert: the store the streaming replay reads."""

    name = "expert-major"
    summary = "each expert's slices adjacent, experts in slot order"
    aliases = ("expert_major", "store")

    def apply(self, spec: LayoutSpec) -> LayoutSpec:
        return with_arrangement(spec, "expert-major", self.name)


PLUGIN = ExpertMajor()
