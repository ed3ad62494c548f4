"""``qwen3moe`` (Qwen3-30B-A3B's family): GQA attention with q/k norms, routed experts only."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gguf import GGUFWriter

from ._base import SynthArch, TensorPlan

if TYPE_CHECKING:
    from ..synth import SynthSpec

ORDER = 10  # the default family lists first


class Qwen3Moe(SynthArch):
    name = "qwen3moe"
    gguf_arch = "qwen3moe"
    summary = "Qwen3-MoE: GQA with q/k norms, routed experts"

    def metadata(self, writer: GGUFWriter, spec: SynthSpec) -> None:
        self.model_sizes(writer, spec)
        self.gqa_heads(writer, spec)
        self.norm_rope_experts(writer, spec, rms_eps=1e-6, rope_base=1_000_000.0)

    def tensors(self, spec: SynthSpec) -> list[TensorPlan]:
        return self.model(spec, lambda _, p: self.gqa_moe_block(spec, p, qk_norm=True))


PLUGIN = Qwen3Moe()
