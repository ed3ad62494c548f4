"""``qwen3next`` (Qwen3-Next-80B-A3B): a hybrid of gated delta-net (linear attention,
recurrent state) and gated full attention, every layer routed experts plus a sigmoid-gated
shared expert; llama.cpp takes gate and up fused (``ffn_gate_up_exps``) or apart.

The delta-net sizes come from the spec's attention knobs: the key/value head width
(``ssm.state_size``) is ``head_dim``, the key heads (``ssm.group_count``) are ``kv_heads``
and the value heads (``ssm.time_step_rank``) are ``heads``. As in the released models, every
fourth layer is full attention and the others delta-net (``full_attention_interval``); a
model of fewer layers has its last one full attention, so that it holds one of each."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gguf import GGUFWriter

from ._base import SynthArch, TensorPlan, need

if TYPE_CHECKING:
    from ..synth import SynthSpec

FULL_ATTENTION_EVERY = 4  # Qwen3-Next's and Qwen3.5's full_attention_interval
CONV_KERNEL = 4


def _shared(spec: SynthSpec) -> int:
    return 1 if spec.shared_experts is None else spec.shared_experts


class Qwen3Next(SynthArch):
    name = "qwen3next"
    gguf_arch = "qwen3next"
    summary = "Qwen3-Next: gated delta-net + gated attention, routed + gated shared expert"
    options = frozenset({"shared_experts", "fused_gate_up"})

    def check(self, spec: SynthSpec) -> None:
        need(_shared(spec) >= 1, f"{self.name} needs a shared expert (shared-experts >= 1)")

    @staticmethod
    def interval(spec: SynthSpec) -> int:
        """Every how many layers one is full attention (llama.cpp: ``(il + 1) % n == 0``)."""
        return min(FULL_ATTENTION_EVERY, spec.layers)

    def is_recurrent(self, spec: SynthSpec, layer: int) -> bool:
        return (layer + 1) % self.interval(spec) != 0

    def metadata(self, writer: GGUFWriter, spec: SynthSpec) -> None:
        self.model_sizes(writer, spec)
        writer.add_expert_shared_feed_forward_length(spec.expert_ffn * _shared(spec))
        self.gqa_heads(writer, spec)
        self.norm_rope_experts(writer, spec, rms_eps=1e-6, rope_base=10_000_000.0)
        writer.add_ssm_conv_kernel(CONV_KERNEL)
        writer.add_ssm_inner_size(spec.head_dim * spec.heads)
        writer.add_ssm_state_size(spec.head_dim)
        writer.add_ssm_time_step_rank(spec.heads)
        writer.add_ssm_group_count(spec.kv_heads)
        writer.add_full_attention_interval(self.interval(spec))

    def tensors(self, spec: SynthSpec) -> list[TensorPlan]:
        return self.model(spec, lambda b, p: self._block(spec, b, p), output=True)

    def _block(self, spec: SynthSpec, b: int, p: str) -> list[TensorPlan]:
        n = spec.hidden
        mixer = (
            self.delta_net(spec, p) if self.is_recurrent(spec, b) else self.gated_attention(spec, p)
        )
        return [
            TensorPlan(p + "attn_norm.weight", (n,), "norm"),
            *mixer,
            TensorPlan(p + "post_attention_norm.weight", (n,), "norm"),
            *self.routed_experts(spec, p, fused=spec.fused_gate_up),
            TensorPlan(p + "ffn_gate_inp_shexp.weight", (n,), "bias"),
            *self.dense_ffn(p, n, spec.expert_ffn * _shared(spec), suffix="_shexp"),
        ]

    @staticmethod
    def gated_attention(spec: SynthSpec, p: str) -> list[TensorPlan]:
        """Full attention whose q projection also yields a per-head output gate."""
        n, hd = spec.hidden, spec.head_dim
        q, kv = spec.heads * hd, spec.kv_heads * hd
        return [
            TensorPlan(p + "attn_q.weight", (2 * q, n), "matrix"),
            TensorPlan(p + "attn_k.weight", (kv, n), "matrix"),
            TensorPlan(p + "attn_v.weight", (kv, n), "matrix"),
            TensorPlan(p + "attn_q_norm.weight", (hd,), "norm"),
            TensorPlan(p + "attn_k_norm.weight", (hd,), "norm"),
            TensorPlan(p + "attn_output.weight", (n, q), "matrix"),
        ]

    def delta_net(self, spec: SynthSpec, p: str) -> list[TensorPlan]:
        """The gated delta-net mixer: q/k/v and z projections, the short convolution, the
        per-head decay (``ssm_a`` < 0, ``ssm_dt`` its bias) and beta/alpha, norm, output."""
        n = spec.hidden
        key, value = spec.head_dim * spec.kv_heads, spec.head_dim * spec.heads
        conv = 2 * key + value
        return [
            TensorPlan(p + "attn_qkv.weight", (conv, n), "matrix"),
            TensorPlan(p + "attn_gate.weight", (value, n), "matrix"),
            TensorPlan(p + "ssm_conv1d.weight", (conv, CONV_KERNEL), "conv"),
            TensorPlan(p + "ssm_dt.bias", (spec.heads,), "bias"),
            TensorPlan(p + "ssm_a", (spec.heads,), "decay"),
            *self.beta_alpha(spec, p),
            TensorPlan(p + "ssm_norm.weight", (spec.head_dim,), "norm"),
            TensorPlan(p + "ssm_out.weight", (n, value), "matrix"),
        ]

    @staticmethod
    def beta_alpha(spec: SynthSpec, p: str) -> list[TensorPlan]:
        """qwen3next projects beta and alpha in one tensor (``ssm_ba``)."""
        return [TensorPlan(p + "ssm_ba.weight", (2 * spec.heads, spec.hidden), "matrix")]


PLUGIN = Qwen3Next()
