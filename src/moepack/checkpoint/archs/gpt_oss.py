"""``gpt-oss`` (OpenAI's open-weight MoE): attention sinks, alternating sliding-window layers,
biases everywhere the router and the experts are (``ffn_gate_inp.bias`` and per-expert
``ffn_{gate,up,down}_exps.bias``: expert-axis tensors of their own shape)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gguf import GGUFWriter

from ._base import SynthArch, TensorPlan

if TYPE_CHECKING:
    from ..synth import SynthSpec


class GptOss(SynthArch):
    name = "gpt-oss"
    gguf_arch = "gpt-oss"
    aliases = ("gpt_oss",)
    summary = "gpt-oss: attention sinks, sliding-window layers, router and expert biases"

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
        writer.add_sliding_window(128)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_rope_freq_base(150_000.0)
        writer.add_expert_count(spec.experts)
        writer.add_expert_used_count(spec.top_k)

    def tensors(self, spec: SynthSpec) -> list[TensorPlan]:
        n, f, e = spec.hidden, spec.expert_ffn, spec.experts
        out = self.embedding(spec)
        for b in range(spec.layers):
            p = f"blk.{b}."
            attn = self.gqa_attention(spec, p, qk_norm=False)
            out += attn
            out += [
                TensorPlan(p + "attn_output.bias", (n,), "bias"),
                TensorPlan(p + "attn_sinks.weight", (spec.heads,), "bias"),
                TensorPlan(p + "post_attention_norm.weight", (n,), "norm"),
            ]
            out += self.routed_experts(spec, p)
            out += [
                TensorPlan(p + "ffn_gate_inp.bias", (e,), "bias"),
                TensorPlan(p + "ffn_gate_exps.bias", (e, f), "expert_bias"),
                TensorPlan(p + "ffn_up_exps.bias", (e, f), "expert_bias"),
                TensorPlan(p + "ffn_down_exps.bias", (e, n), "expert_bias"),
            ]
        return out + self.head(spec, output=True)


PLUGIN = GptOss()
