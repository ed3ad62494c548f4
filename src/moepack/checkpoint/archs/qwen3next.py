"""``qwen3next`` (Qwen3-Next-80B-A3B): a hybrid of gated delta-net (linear attention,
recurrent state) and gated full attention, every layer routed experts plus a sigmoid-gated
shared expert; llama.cpp takes gate and up fused (``ffn_gate_up_exps``) or apart.

The delta-net has heads of its own: value heads ``linear_heads`` (``ssm.time_step_rank``), key
heads ``linear_key_heads`` (``ssm.group_count``) of width ``linear_head_dim``
(``ssm.state_size``, keys and values alike), by default the attention's ``heads``,
``kv_heads`` and ``head_dim`` (Qwen3-Next-80B-A3B and Qwen3.6-35B-A3B: 32 value and 16 key
heads of 128 beside 16/2 attention heads of 256). As in the released models, every
fourth layer is full attention and the others delta-net (``full_attention_interval``); a
model of fewer layers has its last one full attention, so that it holds one of each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gguf import GGUFWriter

from ._base import SynthArch, TensorPlan, need

if TYPE_CHECKING:
    from ..synth import SynthSpec

FULL_ATTENTION_EVERY = 4  # Qwen3-Next's and Qwen3.5's full_attention_interval
CONV_KERNEL = 4


def _shared(spec: SynthSpec) -> int:
    return 1 if spec.shared_experts is None else spec.shared_experts


@dataclass(frozen=True)
class DeltaNetShape:
    """The delta-net's heads (defaults filled in from the attention's)."""

    value_heads: int
    key_heads: int
    head_dim: int

    @property
    def key(self) -> int:
        return self.head_dim * self.key_heads

    @property
    def value(self) -> int:
        return self.head_dim * self.value_heads


def delta_net_shape(spec: SynthSpec) -> DeltaNetShape:
    return DeltaNetShape(
        value_heads=spec.heads if spec.linear_heads is None else spec.linear_heads,
        key_heads=spec.kv_heads if spec.linear_key_heads is None else spec.linear_key_heads,
        head_dim=spec.head_dim if spec.linear_head_dim is None else spec.linear_head_dim,
    )


class Qwen3Next(SynthArch):
    name = "qwen3next"
    gguf_arch = "qwen3next"
    summary = "Qwen3-Next: gated delta-net + gated attention, routed + gated shared expert"
    options = frozenset(
        {"shared_experts", "fused_gate_up", "linear_heads", "linear_key_heads", "linear_head_dim"}
    )

    def check(self, spec: SynthSpec) -> None:
        need(_shared(spec) >= 1, f"{self.name} needs a shared expert (shared-experts >= 1)")
        d = delta_net_shape(spec)
        need(d.value_heads >= 1 and d.key_heads >= 1, "linear heads must be >= 1")
        need(
            d.value_heads % d.key_heads == 0,
            "linear-heads must be a multiple of linear-key-heads",
        )
        need(d.head_dim >= 2, "linear-head-dim must be >= 2")

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
        d = delta_net_shape(spec)
        writer.add_ssm_conv_kernel(CONV_KERNEL)
        writer.add_ssm_inner_size(d.value)
        writer.add_ssm_state_size(d.head_dim)
        writer.add_ssm_time_step_rank(d.value_heads)
        writer.add_ssm_group_count(d.key_heads)
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
        n, d = spec.hidden, delta_net_shape(spec)
        conv = 2 * d.key + d.value
        return [
            TensorPlan(p + "attn_qkv.weight", (conv, n), "matrix"),
            TensorPlan(p + "attn_gate.weight", (d.value, n), "matrix"),
            TensorPlan(p + "ssm_conv1d.weight", (conv, CONV_KERNEL), "conv"),
            TensorPlan(p + "ssm_dt.bias", (d.value_heads,), "bias"),
            TensorPlan(p + "ssm_a", (d.value_heads,), "decay"),
            *self.beta_alpha(spec, p),
            TensorPlan(p + "ssm_norm.weight", (d.head_dim,), "norm"),
            TensorPlan(p + "ssm_out.weight", (n, d.value), "matrix"),
        ]

    @staticmethod
    def beta_alpha(spec: SynthSpec, p: str) -> list[TensorPlan]:
        """qwen3next projects beta and alpha in one tensor (``ssm_ba``)."""
        heads = delta_net_shape(spec).value_heads
        return [TensorPlan(p + "ssm_ba.weight", (2 * heads, spec.hidden), "matrix")]


PLUGIN = Qwen3Next()
