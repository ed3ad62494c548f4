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
        writer.add_context_length(spec.context)
        writer.add_embedding_length(spec.hidden)
        writer.add_block_count(spec.layers)
        writer.add_feed_forward_length(spec.expert_ffn)
        writer.add_head_count(spec.heads)
        writer.add_head_count_kv(spec.kv_heads)
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_rope_freq_base(1_000_000.0)
        writer.add_expert_count(spec.experts)
        writer.add_expert_used_count(spec.top_k)

    def tensors(self, spec: SynthSpec) -> list[TensorPlan]:
        out = self.embedding(spec)
        for b in range(spec.layers):
            p = f"blk.{b}."
            out += self.gqa_attention(spec, p, qk_norm=False)
            out.append(TensorPlan(p + "ffn_norm.weight", (spec.hidden,), "norm"))
            out += self.routed_experts(spec, p)
        return out + self.head(spec)


PLUGIN = Mixtral()
