"""``qwen35moe`` (Qwen3.5/3.6-35B-A3B): qwen3next's hybrid layers with beta and alpha
projected apart (``ssm_beta``, ``ssm_alpha``) and multi-section RoPE on the attention
layers (``rope.dimension_sections``, which llama.cpp requires)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gguf import GGUFWriter

from ._base import TensorPlan, need
from .qwen3next import Qwen3Next, delta_net_shape

if TYPE_CHECKING:
    from ..synth import SynthSpec


class Qwen35Moe(Qwen3Next):
    name = "qwen35moe"
    gguf_arch = "qwen35moe"
    summary = "Qwen3.5-MoE: qwen3next's hybrid layers, beta/alpha apart, sectioned RoPE"

    def check(self, spec: SynthSpec) -> None:
        super().check(spec)
        need(spec.heads % spec.kv_heads == 0, "qwen35moe needs heads a multiple of kv-heads")

    def metadata(self, writer: GGUFWriter, spec: SynthSpec) -> None:
        super().metadata(writer, spec)
        half = spec.head_dim // 2  # the sections cover the rotated half-dimensions
        first = (half + 2) // 3
        writer.add_rope_dimension_sections([first, first, half - 2 * first, 0])

    @staticmethod
    def beta_alpha(spec: SynthSpec, p: str) -> list[TensorPlan]:
        heads = delta_net_shape(spec).value_heads
        return [
            TensorPlan(p + "ssm_beta.weight", (heads, spec.hidden), "matrix"),
            TensorPlan(p + "ssm_alpha.weight", (heads, spec.hidden), "matrix"),
        ]


PLUGIN = Qwen35Moe()
