"""``pipeline``: each block's expert tensors back to back in execution order (gate, up, down)."""

from __future__ import annotations

from ..layout import Layout, LayoutSpec, with_arrangement

ORDER = 30


class Pipeline(Layout):
    """No unrelated tensors between a block's expert matrices, read in the order used."""

    name = "pipeline"
    summary = "a block's expert tensors contiguous, in execution order"

    def apply(self, spec: LayoutSpec) -> LayoutSpec:
        return with_arrangement(spec, "pipeline", self.name)


PLUGIN = Pipeline()
