"""``identity``: the checkpoint as it is, every slice at its own file offset."""

from __future__ import annotations

from ..layout import Layout, LayoutSpec

ORDER = 10


class Identity(Layout):
    """The yardstick every other layout is compared with."""

    name = "identity"
    summary = "the file as it is"
    aliases = ("file",)

    def apply(self, spec: LayoutSpec) -> LayoutSpec:
        return spec


PLUGIN = Identity()
