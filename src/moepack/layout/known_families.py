"""Well-known MoE families, as their published Hugging Face ``config.json`` files state them.

Each entry carries the config keys ``survey`` reads, and ``source``: where those figures are
published (the repository's config.json), so every number can be checked against its origin.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KnownFamily:
    """One family's MoE geometry, from its config.json."""

    name: str
    hidden: int  # hidden_size
    expert_ffn: int  # moe_intermediate_size (or intermediate_size where experts use it)
    experts: int  # num_experts / num_local_experts / n_routed_experts
    top_k: int  # num_experts_per_tok
    layers: int  # num_hidden_layers
    dense_layers: int  # first_k_dense_replace (leading layers without routed experts)
    source: str


def _hf(repo: str) -> str:
    return f"https://huggingface.co/{repo}/blob/main/config.json"


KNOWN: tuple[KnownFamily, ...] = (
    KnownFamily(
        "granite-3.0-1b-a400m",
        1024,
        512,
        32,
        8,
        24,
        0,
        _hf("ibm-granite/granite-3.0-1b-a400m-base"),
    ),
    KnownFamily("OLMoE-1B-7B", 2048, 1024, 64, 8, 16, 0, _hf("allenai/OLMoE-1B-7B-0924")),
    KnownFamily("Qwen1.5-MoE-A2.7B", 2048, 1408, 60, 4, 24, 0, _hf("Qwen/Qwen1.5-MoE-A2.7B")),
    KnownFamily("Qwen3-30B-A3B", 2048, 768, 128, 8, 48, 0, _hf("Qwen/Qwen3-30B-A3B")),
    KnownFamily("DeepSeek-V2-Lite", 2048, 1408, 64, 6, 27, 1, _hf("deepseek-ai/DeepSeek-V2-Lite")),
    KnownFamily("Mixtral-8x7B", 4096, 14336, 8, 2, 32, 0, _hf("mistralai/Mixtral-8x7B-v0.1")),
    KnownFamily("Phi-3.5-MoE", 4096, 6400, 16, 2, 32, 0, _hf("microsoft/Phi-3.5-MoE-instruct")),
    KnownFamily(
        "Qwen3.6-35B-A3B",
        2048,
        512,
        256,
        8,
        40,
        0,
        "text_config of the checkpoint's config.json, as quoted in "
        "shared/reference/npu2-qwen3_6-moe.md",
    ),
    KnownFamily(
        "Qwen3-Next-80B-A3B", 2048, 512, 512, 10, 48, 0, _hf("Qwen/Qwen3-Next-80B-A3B-Instruct")
    ),
    KnownFamily("gpt-oss-20b", 2880, 2880, 32, 4, 24, 0, _hf("openai/gpt-oss-20b")),
    KnownFamily("gpt-oss-120b", 2880, 2880, 128, 4, 36, 0, _hf("openai/gpt-oss-120b")),
    KnownFamily("DeepSeek-V3", 7168, 2048, 256, 8, 61, 3, _hf("deepseek-ai/DeepSeek-V3")),
    KnownFamily("GLM-4.5", 5120, 1536, 160, 8, 92, 3, _hf("zai-org/GLM-4.5")),
)
