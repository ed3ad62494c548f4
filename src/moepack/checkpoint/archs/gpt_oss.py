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
        self.model_sizes(writer, spec)
        self.gqa_heads(writer, spec)
        writer.add_sliding_window(128)
        self.norm_rope_experts(writer, spec, rms_eps=1e-5, rope_base=150_000.0)

    def tensors(self, spec: SynthSpec) -> list[TensorPlan]:
        return self.model(spec, lambda _, p: self._block(spec, p), output=True)

    def _block(self, spec: SynthSpec, p: str) -> list[TensorPlan]:
        """GQA attention with output bias and sinks; biased router and experts."""
        n, f, e = spec.hidden, spec.expert_ffn, spec.experts
        return [
            *self.gqa_attention(spec, p, qk_norm=False),
            TensorPlan(p + "attn_output.bias", (n,), "bias"),
            TensorPlan(p + "attn_sinks.weight", (spec.heads,), "bias"),
            TensorPlan(p + "post_attention_norm.weight", (n,), "norm"),
            *self.routed_experts(spec, p),
            TensorPlan(p + "ffn_gate_inp.bias", (e,), "bias"),
            TensorPlan(p + "ffn_gate_exps.bias", (e, f), "expert_bias"),
            TensorPlan(p + "ffn_up_exps.bias", (e, f), "expert_bias"),
            TensorPlan(p + "ffn_down_exps.bias", (e, n), "expert_bias"),
        ]


PLUGIN = GptOss()
