"""Which architectures stock llama.cpp loads with a fused ``ffn_gate_up_exps`` tensor.

Read from the vendored llama.cpp of llama-cpp-python 0.3.36 (llama.cpp commit 0c1e570): the
model files whose ``load_arch_tensors`` calls ``create_tensor_gate_up_exps`` (or, for gemma4,
creates ``LLM_TENSOR_FFN_GATE_UP_EXPS`` itself), mapped to their ``general.architecture``
names through ``llama-model.cpp``'s architecture switch and ``llama-arch.cpp``'s name table.
mistral4 inherits deepseek2's loader. Every other architecture asks for ``ffn_gate_exps`` and
``ffn_up_exps`` by name and fails to load (missing tensor) or loads with an unused one.
"""

from __future__ import annotations

import os

from ..errors import BadInput

LLAMA_CPP_SOURCE = "llama-cpp-python 0.3.36 (vendored llama.cpp 0c1e570)"

FUSED_GATE_UP_ARCHS: frozenset[str] = frozenset(
    {
        "cohere2moe",  # src/models/cohere2moe.cpp
        "deepseek2",  # src/models/deepseek2.cpp
        "deepseek2-ocr",  # src/models/deepseek2ocr.cpp
        "gemma4",  # src/models/gemma4.cpp (creates the tensor itself)
        "granite_swa",  # src/models/granite-swa.cpp
        "hy_v3",  # src/models/hy-v3.cpp
        "mistral4",  # deepseek2's loader (models.h: llama_model_mistral4)
        "qwen35moe",  # src/models/qwen35moe.cpp
        "qwen3next",  # src/models/qwen3next.cpp
        "qwen4exp",  # src/models/qwen4exp.cpp
    }
)


def takes_fused_gate_up(architecture: str) -> bool:
    return architecture in FUSED_GATE_UP_ARCHS


def check_takes_fused(architecture: str, path: str | os.PathLike[str] | None = None) -> None:
    """``BadInput`` naming the reason when llama.cpp would not load a fused file of this kind."""
    if not takes_fused_gate_up(architecture):
        raise BadInput(
            f"architecture {architecture!r}: llama.cpp's loader for it does not take a fused "
            f"ffn_gate_up_exps tensor (it asks for ffn_gate_exps and ffn_up_exps), so a fused "
            f"file would not load; fused is for {', '.join(sorted(FUSED_GATE_UP_ARCHS))} "
            f"(read from {LLAMA_CPP_SOURCE})",
            path,
        )
