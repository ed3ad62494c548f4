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
        writer.add_context_length(spec.context)
        writer.add_embedding_length(spec.hidden)
        writer.add_block_count(spec.layers)
        writer.add_feed_forward_length(spec.expert_ffn)
        writer.add_expert_feed_forward_length(spec.expert_ffn)
        writer.add_head_count(spec.heads)
        writer.add_head_count_kv(spec.kv_heads)
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
        writer.add_layer_norm_rms_eps(1e-6)
        writer.add_rope_freq_base(1_000_000.0)
        writer.add_expert_count(spec.experts)
        writer.add_expert_used_count(spec.top_k)

    def tensors(self, spec: SynthSpec) -> list[TensorPlan]:
        out = self.embedding(spec)
        for b in range(spec.layers):
            p = f"blk.{b}."
            out += self.gqa_attention(spec, p, qk_norm=True)
            out.append(TensorPlan(p + "ffn_norm.weight", (spec.hidden,), "norm"))
            out += self.routed_experts(spec, p)
        return out + self.head(spec)


PLUGIN = Qwen3Moe()
