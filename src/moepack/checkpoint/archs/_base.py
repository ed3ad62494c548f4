"""The interface every synthetic architecture implements, written once.

An architecture says which tensors a model of a ``SynthSpec`` has (names, numpy shapes, the
role that decides how values are drawn and stored) and which metadata llama.cpp's loader
for that family reads. Everything else (values, quantisation, streaming the file out) is
shared in ``moepack.checkpoint.synth``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gguf import GGUFWriter

from ...errors import BadInput

if TYPE_CHECKING:
    from ..synth import SynthSpec

# Roles stored in F32 whatever the weight type (llama.cpp keeps norms, routers and biases F32,
# and a delta-net's short convolution and its per-head decay).
F32_ROLES = frozenset({"norm", "router", "bias", "expert_bias", "conv", "decay"})


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of a synthetic model: ``shape`` is numpy's (reversed ggml ne)."""

    name: str
    shape: tuple[int, ...]
    role: str  # matrix | experts | norm | router | bias | expert_bias | conv | decay

    @property
    def stored_f32(self) -> bool:
        return self.role in F32_ROLES


def need(cond: bool, msg: str) -> None:
    """Refuse a spec the architecture cannot express, in the words of the spec."""
    if not cond:
        raise BadInput(f"synthetic model spec: {msg}")


class SynthArch:
    """One MoE family llama.cpp runs. Subclasses set ``name`` (what ``--arch`` takes),
    ``gguf_arch`` (``general.architecture``) and the options they accept, and implement
    ``metadata`` and ``tensors``."""

    name: str = ""
    gguf_arch: str = ""
    aliases: tuple[str, ...] = ()
    summary: str = ""
    gating: str = "softmax"  # how router logits become selection scores (softmax | sigmoid)
    # SynthSpec fields beyond the common ones that this family understands.
    options: frozenset[str] = frozenset()

    def check(self, spec: SynthSpec) -> None:
        """Family-specific limits (the common ones are checked by ``SynthSpec.validate``)."""

    def expert_groups(self, spec: SynthSpec) -> int:
        """How many expert groups grouped routing uses (1: no groups)."""
        return 1

    def nextn_layers(self, spec: SynthSpec) -> int:
        """How many last blocks are multi-token-prediction blocks (``nextn_predict_layers``:
        llama.cpp loads them and never runs them, see ``checkpoint.nextn``)."""
        return 0

    def head_count_kv(self, spec: SynthSpec) -> int:
        """``attention.head_count_kv`` as written (llama.cpp's type mix reads heads / this)."""
        return spec.kv_heads

    def llama_70b(self, spec: SynthSpec) -> bool:
        """llama.cpp takes this model for its ``LLM_TYPE_70B`` (whose value projections get
        more bits in a K-quant file); only the llama architecture has that type."""
        return False

    def metadata(self, writer: GGUFWriter, spec: SynthSpec) -> None:
        """Write the family's hyper-parameter keys (everything but name, file type, tokenizer)."""
        raise NotImplementedError

    def tensors(self, spec: SynthSpec) -> list[TensorPlan]:
        """Every tensor, in file order."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shared metadata
    @staticmethod
    def model_sizes(writer: GGUFWriter, spec: SynthSpec, expert_ffn_key: bool = True) -> None:
        """Context, width, depth and FFN width (the dense blocks', by default the experts'; and
        the expert FFN width key if the family reads it)."""
        writer.add_context_length(spec.context)
        writer.add_embedding_length(spec.hidden)
        writer.add_block_count(spec.layers)
        writer.add_feed_forward_length(SynthArch.dense_width(spec))
        if expert_ffn_key:
            writer.add_expert_feed_forward_length(spec.expert_ffn)

    @staticmethod
    def gqa_heads(writer: GGUFWriter, spec: SynthSpec, head_lengths: bool = True) -> None:
        """Query and key/value head counts (and the per-head key/value lengths)."""
        writer.add_head_count(spec.heads)
        writer.add_head_count_kv(spec.kv_heads)
        if head_lengths:
            writer.add_key_length(spec.head_dim)
            writer.add_value_length(spec.head_dim)

    @staticmethod
    def norm_rope_experts(
        writer: GGUFWriter, spec: SynthSpec, rms_eps: float, rope_base: float
    ) -> None:
        """RMS-norm epsilon, RoPE base, and how many experts there are and are used per token."""
        writer.add_layer_norm_rms_eps(rms_eps)
        writer.add_rope_freq_base(rope_base)
        writer.add_expert_count(spec.experts)
        writer.add_expert_used_count(spec.top_k)

    @staticmethod
    def dense_width(spec: SynthSpec) -> int:
        """The FFN width of dense (not MoE) blocks: ``dense_ffn``, by default the experts'."""
        return spec.expert_ffn if spec.dense_ffn is None else spec.dense_ffn

    # ------------------------------------------------------------------ shared tensors
    def model(
        self,
        spec: SynthSpec,
        block: Callable[[int, str], list[TensorPlan]],
        output: bool | None = None,
    ) -> list[TensorPlan]:
        """Embedding, then ``block(index, "blk.{index}.")`` for every layer, then the head."""
        out = self.embedding(spec)
        for b in range(spec.layers):
            out += block(b, f"blk.{b}.")
        return out + self.head(spec, output)

    @classmethod
    def gqa_moe_block(cls, spec: SynthSpec, prefix: str, qk_norm: bool) -> list[TensorPlan]:
        """The plain MoE layer: GQA attention, FFN norm, router and routed experts."""
        out = cls.gqa_attention(spec, prefix, qk_norm)
        out.append(TensorPlan(prefix + "ffn_norm.weight", (spec.hidden,), "norm"))
        return out + cls.routed_experts(spec, prefix)

    @staticmethod
    def embedding(spec: SynthSpec) -> list[TensorPlan]:
        return [TensorPlan("token_embd.weight", (spec.vocab, spec.hidden), "matrix")]

    @staticmethod
    def head(spec: SynthSpec, output: bool | None = None) -> list[TensorPlan]:
        out = [TensorPlan("output_norm.weight", (spec.hidden,), "norm")]
        if spec.with_output if output is None else output:
            out.append(TensorPlan("output.weight", (spec.vocab, spec.hidden), "matrix"))
        return out

    @staticmethod
    def gqa_attention(spec: SynthSpec, prefix: str, qk_norm: bool) -> list[TensorPlan]:
        """Grouped-query attention with separate q/k/v (optionally qwen3's q/k norms)."""
        n, hd = spec.hidden, spec.head_dim
        q, kv = spec.heads * hd, spec.kv_heads * hd
        out = [
            TensorPlan(prefix + "attn_norm.weight", (n,), "norm"),
            TensorPlan(prefix + "attn_q.weight", (q, n), "matrix"),
            TensorPlan(prefix + "attn_k.weight", (kv, n), "matrix"),
            TensorPlan(prefix + "attn_v.weight", (kv, n), "matrix"),
        ]
        if qk_norm:
            out += [
                TensorPlan(prefix + "attn_q_norm.weight", (hd,), "norm"),
                TensorPlan(prefix + "attn_k_norm.weight", (hd,), "norm"),
            ]
        out.append(TensorPlan(prefix + "attn_output.weight", (n, q), "matrix"))
        return out

    @staticmethod
    def routed_experts(spec: SynthSpec, prefix: str, fused: bool = False) -> list[TensorPlan]:
        """Router and the expert-axis FFN (gate and up separate, or fused as gate_up)."""
        n, f, e = spec.hidden, spec.expert_ffn, spec.experts
        out = [TensorPlan(prefix + "ffn_gate_inp.weight", (e, n), "router")]
        if fused:
            out.append(TensorPlan(prefix + "ffn_gate_up_exps.weight", (e, 2 * f, n), "experts"))
        else:
            out += [
                TensorPlan(prefix + "ffn_gate_exps.weight", (e, f, n), "experts"),
                TensorPlan(prefix + "ffn_up_exps.weight", (e, f, n), "experts"),
            ]
        out.append(TensorPlan(prefix + "ffn_down_exps.weight", (e, n, f), "experts"))
        return out

    @staticmethod
    def nextn_head(spec: SynthSpec, prefix: str) -> list[TensorPlan]:
        """What a multi-token-prediction block adds to its layer (llama.cpp's
        ``LLM_TENSOR_NEXTN_*``): the projection of [embedding; hidden state] and its norms."""
        n = spec.hidden
        return [
            TensorPlan(prefix + "nextn.eh_proj.weight", (n, 2 * n), "matrix"),
            TensorPlan(prefix + "nextn.enorm.weight", (n,), "norm"),
            TensorPlan(prefix + "nextn.hnorm.weight", (n,), "norm"),
            TensorPlan(prefix + "nextn.shared_head_norm.weight", (n,), "norm"),
        ]

    @staticmethod
    def dense_ffn(prefix: str, hidden: int, width: int, suffix: str = "") -> list[TensorPlan]:
        """A SwiGLU FFN: ``ffn_{gate,up,down}{suffix}`` (suffix ``_shexp`` for shared experts)."""
        return [
            TensorPlan(f"{prefix}ffn_gate{suffix}.weight", (width, hidden), "matrix"),
            TensorPlan(f"{prefix}ffn_up{suffix}.weight", (width, hidden), "matrix"),
            TensorPlan(f"{prefix}ffn_down{suffix}.weight", (hidden, width), "matrix"),
        ]
