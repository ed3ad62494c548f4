"""Mixtral-style MoE: llama.cpp's ``llama`` architecture with experts (Mixtral 8x7B, 8x22B):
GQA attention without q/k norms, softmax router, routed experts only. ``feed_forward_length``
is the expert width (llama has no separate expert key)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gguf import GGUFWriter

from ._base import SynthArch, TensorPlan

if TYPE_CHECKING:
    from ..synth import SynthSpec


class Mixtral(SynthArch):
    name = "mixtral"
    gguf_arch = "llama"
    aliases = ("llama-moe",)
    summary = "Mixtral: llama with routed experts"

    def metadata(self, writer: GGUFWriter, spec: SynthSpec) -> None:
        self.model_sizes(writer, spec, expert_ffn_key=False)
        self.gqa_heads(writer, spec)
        self.norm_rope_experts(writer, spec, rms_eps=1e-5, rope_base=1_000_000.0)

    def llama_70b(self, spec: SynthSpec) -> bool:
        """llama.cpp's rule for the llama architecture: 80 layers of grouped-query attention
        and not 8 experts (8 experts make it 8x7B or 8x22B)."""
        return spec.experts != 8 and spec.layers == 80 and spec.heads != spec.kv_heads

    def tensors(self, spec: SynthSpec) -> list[TensorPlan]:
        return self.model(spec, lambda _, p: self.gqa_moe_block(spec, p, qk_norm=False))


PLUGIN = Mixtral()
