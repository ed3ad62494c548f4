"""``deepseek2`` (DeepSeek-V2/V3, Kimi-K2, GLM-4.7 Lite as llama.cpp loads them): MLA
attention, dense leading blocks, shared experts, grouped routing with a sigmoid gate and the
``exp_probs_b`` selection bias, optionally ``ffn_gate_up_exps`` fused, and optionally
DeepSeek-V3's multi-token-prediction block(s) at the end (``nextn_layers``: a MoE layer plus
the ``nextn.*`` head, which llama.cpp loads and never runs).

MLA is written the way llama.cpp's converter writes it today (the "absorbed" form): per head
``attn_k_b`` / ``attn_v_b`` instead of ``attn_kv_b``, a single KV head whose key is
``kv_lora_rank + rope`` wide (``attention.key_length``) and whose value is the latent
(``attention.value_length = kv_lora_rank``); the per-head sizes go in the ``*_mla`` keys.
Sizes derive from the spec: nope = v = head_dim, rope = head_dim / 2, kv_lora = 2·head_dim,
q_lora = hidden / 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gguf import ExpertGatingFuncType, GGUFWriter

from ._base import SynthArch, TensorPlan, need

if TYPE_CHECKING:
    from ..synth import SynthSpec


@dataclass(frozen=True)
class DeepseekShape:
    """The derived sizes of one deepseek2 spec (defaults filled in)."""

    shared: int
    groups: int
    groups_used: int
    dense: int
    nope: int
    rope: int
    v: int
    kv_lora: int
    q_lora: int
    nextn: int


def shape_of(spec: SynthSpec) -> DeepseekShape:
    e, k = spec.experts, spec.top_k
    if spec.expert_groups is not None:
        groups = spec.expert_groups
    else:
        groups = 4 if e % 4 == 0 and e // 4 >= 2 else 1
    if spec.groups_used is not None:
        used = spec.groups_used
    elif groups > 1:
        per = e // groups
        used = max(groups // 2, -(-k // per))
        used = min(used, groups - 1)
    else:
        used = 0
    dense = spec.dense_layers if spec.dense_layers is not None else (1 if spec.layers > 1 else 0)
    hd = spec.head_dim
    return DeepseekShape(
        shared=1 if spec.shared_experts is None else spec.shared_experts,
        groups=groups,
        groups_used=used,
        dense=dense,
        nope=hd,
        rope=hd // 2,
        v=hd,
        kv_lora=2 * hd,
        q_lora=spec.hidden // 2,
        nextn=spec.nextn_layers or 0,
    )


class Deepseek2(SynthArch):
    name = "deepseek2"
    gguf_arch = "deepseek2"
    summary = "DeepSeek-V3 style: MLA, dense leading blocks, shared experts, grouped routing"
    gating = "sigmoid"
    options = frozenset(
        {
            "shared_experts",
            "expert_groups",
            "groups_used",
            "dense_layers",
            "fused_gate_up",
            "nextn_layers",
            "dense_ffn",
        }
    )

    def check(self, spec: SynthSpec) -> None:
        s = shape_of(spec)
        need(s.shared >= 1, "deepseek2 needs at least one shared expert")
        need(0 <= s.dense < spec.layers, "dense layers must leave at least one MoE layer")
        need(
            s.dense < spec.layers - s.nextn,
            "dense and next-token-prediction layers must leave at least one MoE layer that runs",
        )
        need(spec.head_dim % 4 == 0, "deepseek2 head-dim must be a multiple of 4 (rope = half)")
        if s.groups > 1:
            need(spec.experts % s.groups == 0, "experts must be a multiple of expert groups")
            need(spec.experts // s.groups >= 2, "each expert group needs at least 2 experts")
            need(
                1 <= s.groups_used < s.groups,
                "groups used must be between 1 and expert groups - 1",
            )
            need(
                s.groups_used * (spec.experts // s.groups) >= spec.top_k,
                "the groups used must hold at least top-k experts",
            )
        else:
            need(spec.groups_used in (None, 0), "groups used needs expert groups > 1")

    def expert_groups(self, spec: SynthSpec) -> int:
        return shape_of(spec).groups

    def nextn_layers(self, spec: SynthSpec) -> int:
        return shape_of(spec).nextn

    def head_count_kv(self, spec: SynthSpec) -> int:
        return 1  # MLA's one latent head

    def metadata(self, writer: GGUFWriter, spec: SynthSpec) -> None:
        s = shape_of(spec)
        self.model_sizes(writer, spec)
        writer.add_leading_dense_block_count(s.dense)
        writer.add_head_count(spec.heads)
        writer.add_head_count_kv(1)
        writer.add_key_length(s.kv_lora + s.rope)
        writer.add_value_length(s.kv_lora)
        writer.add_key_length_mla(s.nope + s.rope)
        writer.add_value_length_mla(s.v)
        writer.add_q_lora_rank(s.q_lora)
        writer.add_kv_lora_rank(s.kv_lora)
        writer.add_rope_dimension_count(s.rope)
        self.norm_rope_experts(writer, spec, rms_eps=1e-6, rope_base=10_000.0)
        writer.add_expert_shared_count(s.shared)
        if s.groups > 1:
            writer.add_expert_group_count(s.groups)
            writer.add_expert_group_used_count(s.groups_used)
        writer.add_expert_weights_scale(1.0)
        writer.add_expert_weights_norm(True)
        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        if s.nextn:
            writer.add_nextn_predict_layers(s.nextn)

    def tensors(self, spec: SynthSpec) -> list[TensorPlan]:
        s = shape_of(spec)
        n, h = spec.hidden, spec.heads
        out = self.embedding(spec)
        for b in range(spec.layers):
            p = f"blk.{b}."
            out += [
                TensorPlan(p + "attn_norm.weight", (n,), "norm"),
                TensorPlan(p + "attn_q_a_norm.weight", (s.q_lora,), "norm"),
                TensorPlan(p + "attn_kv_a_norm.weight", (s.kv_lora,), "norm"),
                TensorPlan(p + "attn_q_a.weight", (s.q_lora, n), "matrix"),
                TensorPlan(p + "attn_q_b.weight", (h * (s.nope + s.rope), s.q_lora), "matrix"),
                TensorPlan(p + "attn_kv_a_mqa.weight", (s.kv_lora + s.rope, n), "matrix"),
                TensorPlan(p + "attn_k_b.weight", (h, s.kv_lora, s.nope), "matrix"),
                TensorPlan(p + "attn_v_b.weight", (h, s.v, s.kv_lora), "matrix"),
                TensorPlan(p + "attn_output.weight", (n, h * s.v), "matrix"),
                TensorPlan(p + "ffn_norm.weight", (n,), "norm"),
            ]
            if b < s.dense:
                out += self.dense_ffn(p, n, self.dense_width(spec))
                continue
            out += self.routed_experts(spec, p, fused=spec.fused_gate_up)
            out.append(TensorPlan(p + "exp_probs_b.bias", (spec.experts,), "bias"))
            out += self.dense_ffn(p, n, spec.expert_ffn * s.shared, suffix="_shexp")
            if b >= spec.layers - s.nextn:
                out += self.nextn_head(spec, p)
        return out + self.head(spec)


PLUGIN = Deepseek2()
