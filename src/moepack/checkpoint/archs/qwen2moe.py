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
        self.model_sizes(writer, spec)
        writer.add_expert_shared_feed_forward_length(spec.expert_ffn * _shared(spec))
        self.gqa_heads(writer, spec, head_lengths=False)
        self.norm_rope_experts(writer, spec, rms_eps=1e-6, rope_base=1_000_000.0)

    def tensors(self, spec: SynthSpec) -> list[TensorPlan]:
        return self.model(spec, lambda _, p: self._block(spec, p), output=True)

    def _block(self, spec: SynthSpec, p: str) -> list[TensorPlan]:
        """The plain MoE layer plus the sigmoid-gated shared expert."""
        n = spec.hidden
        return [
            *self.gqa_moe_block(spec, p, qk_norm=False),
            TensorPlan(p + "ffn_gate_inp_shexp.weight", (n,), "bias"),
            *self.dense_ffn(p, n, spec.expert_ffn * _shared(spec), suffix="_shexp"),
        ]


PLUGIN = Qwen2Moe()
