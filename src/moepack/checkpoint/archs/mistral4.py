"""``mistral4``: llama.cpp loads it with deepseek2's hyper-parameters and tensors (MLA, dense
leading blocks, shared experts, grouped sigmoid routing, optionally ``ffn_gate_up_exps``);
its graph is deepseek2's with the down projection's input kept in F32. A second architecture
whose loader takes the fused gate+up, at no extra cost to synthesise."""

from __future__ import annotations

from .deepseek2 import Deepseek2


class Mistral4(Deepseek2):
    name = "mistral4"
    gguf_arch = "mistral4"
    summary = "Mistral 4 as llama.cpp loads it: deepseek2's tensors and hyper-parameters"


PLUGIN = Mistral4()
