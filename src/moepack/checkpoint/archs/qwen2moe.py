"""``qwen2moe`` (Qwen1.5-MoE, Qwen2-57B-A14B): attention as wide as the model, routed experts
plus a shared expert whose output a sigmoid gate (``ffn_gate_inp_shexp``, a vector of length
n_embd, not an expert-axis tensor) scales."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gguf import GGUFWriter

from ._base import SynthArch, TensorPlan, need

if TYPE_CHECKING:
    from ..synth import SynthSpec


def _shared(spec: SynthSpec) -> int:
    return 1 if spec.shared_experts is None else spec.shared_experts


class Qwen2Moe(SynthArch):
    name = "qwen2moe"
    gguf_arch = "qwen2moe"
    summary = "Qwen2-MoE: routed experts plus a gated shared expert"
    options = frozenset({"shared_experts"})

    def check(self, spec: SynthSpec) -> None:
        need(_shared(spec) >= 1, "qwen2moe needs a shared expert (shared-experts >= 1)")
        need(
            spec.heads * spec.head_dim == spec.hidden,
            "qwen2moe attention is as wide as the model: heads x head-dim must equal hidden",
        )

    def metadata(self, writer: GGUFWriter, spec: SynthSpec) -> None:
        writer.add_context_length(spec.context)
        writer.add_embedding_length(spec.hidden)
        writer.add_block_count(spec.layers)
        writer.add_feed_forward_length(spec.expert_ffn)
        writer.add_expert_feed_forward_length(spec.expert_ffn)
        writer.add_expert_shared_feed_forward_length(spec.expert_ffn * _shared(spec))
        writer.add_head_count(spec.heads)
        writer.add_head_count_kv(spec.kv_heads)
        writer.add_layer_norm_rms_eps(1e-6)
        writer.add_rope_freq_base(1_000_000.0)
        writer.add_expert_count(spec.experts)
        writer.add_expert_used_count(spec.top_k)

    def tensors(self, spec: SynthSpec) -> list[TensorPlan]:
        n = spec.hidden
        out = self.embedding(spec)
        for b in range(spec.layers):
            p = f"blk.{b}."
            out += self.gqa_attention(spec, p, qk_norm=False)
            out.append(TensorPlan(p + "ffn_norm.weight", (n,), "norm"))
            out += self.routed_experts(spec, p)
            out.append(TensorPlan(p + "ffn_gate_inp_shexp.weight", (n,), "bias"))
            out += self.dense_ffn(p, n, spec.expert_ffn * _shared(spec), suffix="_shexp")
        return out + self.head(spec, output=True)


PLUGIN = Qwen2Moe()
