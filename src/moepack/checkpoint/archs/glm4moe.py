"""``glm4moe`` (GLM-4.5, GLM-4.5-Air, as llama.cpp loads them): GQA attention with q/k/v
biases and a post-attention norm, dense leading blocks, routed experts chosen by a sigmoid gate
with the ``exp_probs_b`` selection bias, a shared expert, partial RoPE (half the head), and the
multi-token-prediction block GLM-4.5 ships as its last block (``nextn_predict_layers``, one by
default as in every GLM-4.5 file): a whole MoE layer plus the ``nextn.*`` head. llama.cpp loads
that block and never runs it (``checkpoint.nextn``), so it is the family that shows what
moepack does with experts llama.cpp never routes to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gguf import ExpertGatingFuncType, GGUFWriter

from ._base import SynthArch, TensorPlan, need

if TYPE_CHECKING:
    from ..synth import SynthSpec


def _shared(spec: SynthSpec) -> int:
    return 1 if spec.shared_experts is None else spec.shared_experts


def _dense(spec: SynthSpec) -> int:
    if spec.dense_layers is not None:
        return spec.dense_layers
    return 1 if spec.layers > 2 else 0


def _nextn(spec: SynthSpec) -> int:
    return 1 if spec.nextn_layers is None else spec.nextn_layers


class Glm4Moe(SynthArch):
    name = "glm4moe"
    gguf_arch = "glm4moe"
    summary = "GLM-4.5: sigmoid-gated experts, shared expert, and an MTP block llama.cpp never runs"
    gating = "sigmoid"
    options = frozenset({"shared_experts", "dense_layers", "nextn_layers", "dense_ffn"})

    def check(self, spec: SynthSpec) -> None:
        need(_shared(spec) >= 1, "glm4moe needs a shared expert (shared-experts >= 1)")
        need(
            _dense(spec) < spec.layers - _nextn(spec),
            "dense and next-token-prediction layers must leave at least one MoE layer that runs",
        )
        need(spec.head_dim % 4 == 0, "glm4moe head-dim must be a multiple of 4 (rope = half)")

    def nextn_layers(self, spec: SynthSpec) -> int:
        return _nextn(spec)

    def metadata(self, writer: GGUFWriter, spec: SynthSpec) -> None:
        self.model_sizes(writer, spec)
        self.gqa_heads(writer, spec)
        writer.add_rope_dimension_count(spec.head_dim // 2)
        self.norm_rope_experts(writer, spec, rms_eps=1e-5, rope_base=1_000_000.0)
        writer.add_leading_dense_block_count(_dense(spec))
        writer.add_expert_shared_count(_shared(spec))
        writer.add_expert_weights_scale(1.0)
        writer.add_expert_weights_norm(True)
        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        if _nextn(spec):
            writer.add_nextn_predict_layers(_nextn(spec))

    def tensors(self, spec: SynthSpec) -> list[TensorPlan]:
        return self.model(spec, lambda b, p: self._block(spec, b, p), output=True)

    def _block(self, spec: SynthSpec, b: int, p: str) -> list[TensorPlan]:
        n, hd = spec.hidden, spec.head_dim
        q, kv = spec.heads * hd, spec.kv_heads * hd
        out = [
            TensorPlan(p + "attn_norm.weight", (n,), "norm"),
            TensorPlan(p + "attn_q.weight", (q, n), "matrix"),
            TensorPlan(p + "attn_q.bias", (q,), "bias"),
            TensorPlan(p + "attn_k.weight", (kv, n), "matrix"),
            TensorPlan(p + "attn_k.bias", (kv,), "bias"),
            TensorPlan(p + "attn_v.weight", (kv, n), "matrix"),
            TensorPlan(p + "attn_v.bias", (kv,), "bias"),
            TensorPlan(p + "attn_output.weight", (n, q), "matrix"),
            TensorPlan(p + "post_attention_norm.weight", (n,), "norm"),
        ]
        if b < _dense(spec):
            return out + self.dense_ffn(p, n, self.dense_width(spec))
        out += self.routed_experts(spec, p)
        out.append(TensorPlan(p + "exp_probs_b.bias", (spec.experts,), "bias"))
        out += self.dense_ffn(p, n, spec.expert_ffn * _shared(spec), suffix="_shexp")
        if b >= spec.layers - _nextn(spec):
            out += self.nextn_head(spec, p)
        return out


PLUGIN = Glm4Moe()
