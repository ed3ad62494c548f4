"""Shapes of the MoE models people run, for ``moepack synth --shape NAME``: every size a
synthetic model of that family needs, from the model's published Hugging Face
``config.json`` (the repository and the fields are named with each shape). A synthetic model
of a shape has the real model's tensors, names, shapes and so its bytes, in any weight type;
its values are noise (see ``synth_values``).

What the families cannot say is left out and named: the real models rotate part of each head
(``partial_rotary_factor``) where the synthetic ones rotate all of it, and their tokenizer is
not copied (the vocabulary's size is). The context length is the published one, so a run's
memory plan can be asked about the contexts the real model takes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from ..errors import BadInput
from .routing import RoutingSpec
from .synth import SynthSpec


@dataclass(frozen=True)
class Shape:
    """One published model's sizes as ``SynthSpec`` fields, and where they come from."""

    name: str
    model: str  # the Hugging Face repository
    sizes: tuple[tuple[str, Any], ...]  # SynthSpec field -> value
    source: str  # config.json fields the sizes are read from
    published: str  # the weight types its GGUF files are usually run in

    def spec(self) -> SynthSpec:
        return SynthSpec(**dict(self.sizes))


SHAPES: tuple[Shape, ...] = (
    Shape(
        "qwen3-30b-a3b",
        "Qwen/Qwen3-30B-A3B",
        (
            ("arch", "qwen3moe"),
            ("layers", 48),  # num_hidden_layers
            ("experts", 128),  # num_experts
            ("top_k", 8),  # num_experts_per_tok
            ("hidden", 2048),  # hidden_size
            ("expert_ffn", 768),  # moe_intermediate_size
            ("heads", 32),  # num_attention_heads
            ("kv_heads", 4),  # num_key_value_heads
            ("head_dim", 128),  # head_dim
            ("vocab", 151936),  # vocab_size
            ("context", 40960),  # max_position_embeddings
        ),
        "num_hidden_layers 48, num_experts 128, num_experts_per_tok 8, hidden_size 2048, "
        "moe_intermediate_size 768, num_attention_heads 32, num_key_value_heads 4, head_dim 128, "
        "vocab_size 151936, tie_word_embeddings false, max_position_embeddings 40960",
        "Q4_0, Q4_K_M, Q8_0",
    ),
    Shape(
        "qwen3.6-35b-a3b",
        "Qwen/Qwen3.6-35B-A3B",
        (
            ("arch", "qwen35moe"),
            ("layers", 40),  # num_hidden_layers (full_attention_interval 4: 3 of 4 delta-net)
            ("experts", 256),  # num_experts
            ("top_k", 8),  # num_experts_per_tok
            ("hidden", 2048),  # hidden_size
            ("expert_ffn", 512),  # moe_intermediate_size (= shared_expert_intermediate_size)
            ("heads", 16),  # num_attention_heads
            ("kv_heads", 2),  # num_key_value_heads
            ("head_dim", 256),  # head_dim
            ("vocab", 248320),  # vocab_size
            ("context", 262144),  # max_position_embeddings
            ("shared_experts", 1),
            ("linear_heads", 32),  # linear_num_value_heads
            ("linear_key_heads", 16),  # linear_num_key_heads
            ("linear_head_dim", 128),  # linear_key_head_dim = linear_value_head_dim
        ),
        "text_config: num_hidden_layers 40, full_attention_interval 4, num_experts 256, "
        "num_experts_per_tok 8, hidden_size 2048, moe_intermediate_size 512, "
        "shared_expert_intermediate_size 512, num_attention_heads 16, num_key_value_heads 2, "
        "head_dim 256, linear_num_value_heads 32, linear_num_key_heads 16, "
        "linear_key_head_dim 128, linear_value_head_dim 128, vocab_size 248320, "
        "max_position_embeddings 262144 (Qwen3.5-35B-A3B's text_config is the same)",
        "Q4_K_M, Q8_0",
    ),
    Shape(
        "qwen3-next-80b-a3b",
        "Qwen/Qwen3-Next-80B-A3B-Instruct",
        (
            ("arch", "qwen3next"),
            ("layers", 48),
            ("experts", 512),
            ("top_k", 10),
            ("hidden", 2048),
            ("expert_ffn", 512),
            ("heads", 16),
            ("kv_heads", 2),
            ("head_dim", 256),
            ("vocab", 151936),
            ("context", 262144),  # max_position_embeddings
            ("shared_experts", 1),
            ("linear_heads", 32),
            ("linear_key_heads", 16),
            ("linear_head_dim", 128),
        ),
        "num_hidden_layers 48, full_attention_interval 4, num_experts 512, "
        "num_experts_per_tok 10, hidden_size 2048, moe_intermediate_size 512, "
        "shared_expert_intermediate_size 512, num_attention_heads 16, num_key_value_heads 2, "
        "head_dim 256, linear_num_value_heads 32, linear_num_key_heads 16, "
        "linear_key_head_dim 128, linear_value_head_dim 128, vocab_size 151936, "
        "max_position_embeddings 262144",
        "Q4_K_M",
    ),
    Shape(
        "gpt-oss-20b",
        "openai/gpt-oss-20b",
        (
            ("arch", "gpt-oss"),
            ("layers", 24),
            ("experts", 32),
            ("top_k", 4),
            ("hidden", 2880),
            ("expert_ffn", 2880),
            ("heads", 64),
            ("kv_heads", 8),
            ("head_dim", 64),
            ("vocab", 201088),
            ("context", 131072),  # max_position_embeddings
        ),
        "num_hidden_layers 24, num_local_experts 32, num_experts_per_tok 4, hidden_size 2880, "
        "intermediate_size 2880, num_attention_heads 64, num_key_value_heads 8, head_dim 64, "
        "vocab_size 201088, max_position_embeddings 131072",
        "MXFP4_MOE (its experts are MXFP4 as released)",
    ),
    Shape(
        "mixtral-8x7b",
        "mistralai/Mixtral-8x7B-v0.1",
        (
            ("arch", "mixtral"),
            ("layers", 32),
            ("experts", 8),
            ("top_k", 2),
            ("hidden", 4096),
            ("expert_ffn", 14336),
            ("heads", 32),
            ("kv_heads", 8),
            ("head_dim", 128),
            ("vocab", 32000),
            ("context", 32768),  # max_position_embeddings
        ),
        "num_hidden_layers 32, num_local_experts 8, num_experts_per_tok 2, hidden_size 4096, "
        "intermediate_size 14336, num_attention_heads 32, num_key_value_heads 8 (head_dim "
        "4096 / 32), vocab_size 32000, max_position_embeddings 32768",
        "Q4_K_M, Q4_0",
    ),
    Shape(
        "glm-4.5-air",
        "zai-org/GLM-4.5-Air",
        (
            ("arch", "glm4moe"),
            ("layers", 47),  # num_hidden_layers 46 + num_nextn_predict_layers 1
            ("experts", 128),
            ("top_k", 8),
            ("hidden", 4096),
            ("expert_ffn", 1408),
            ("heads", 96),
            ("kv_heads", 8),
            ("head_dim", 128),
            ("vocab", 151552),
            ("context", 131072),  # max_position_embeddings
            ("shared_experts", 1),
            ("dense_layers", 1),
            ("nextn_layers", 1),
            ("dense_ffn", 10944),
        ),
        "num_hidden_layers 46 (+ num_nextn_predict_layers 1, as llama.cpp's block_count 47), "
        "n_routed_experts 128, num_experts_per_tok 8, n_shared_experts 1, "
        "first_k_dense_replace 1, hidden_size 4096, moe_intermediate_size 1408, "
        "intermediate_size 10944, num_attention_heads 96, num_key_value_heads 8, head_dim 128, "
        "vocab_size 151552, max_position_embeddings 131072",
        "Q4_K_M",
    ),
)


def shape_names() -> list[str]:
    return [s.name for s in SHAPES]


def get_shape(name: str) -> Shape:
    for s in SHAPES:
        if s.name == name.lower():
            return s
    raise BadInput(f"unknown shape {name!r}; known: {', '.join(shape_names())}")


def synth_spec(
    shape: str | None = None, routing_text: str | None = None, **given: Any
) -> SynthSpec:
    """A ``SynthSpec`` of ``shape`` (its sizes) with every field in ``given`` that is not None
    taking precedence, and the spec's defaults for the rest; ``routing_text`` plants routing
    (``RoutingSpec.parse``, its cluster size defaulting to the resolved top-k)."""
    base = get_shape(shape).spec() if shape is not None else SynthSpec()
    known = {f.name for f in fields(SynthSpec)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise BadInput(f"synthetic model spec: no field {', '.join(unknown)}")
    spec = replace(base, **{k: v for k, v in given.items() if v is not None})
    if routing_text is not None:
        spec = replace(spec, routing=RoutingSpec.parse(routing_text, spec.top_k))
    return spec
