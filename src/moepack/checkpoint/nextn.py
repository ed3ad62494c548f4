"""Blocks llama.cpp loads but never runs: multi-token-prediction (MTP, "NextN") blocks.

GLM-4.5 (``glm4moe``), DeepSeek-V3 (``deepseek2``), Qwen3-Next, Qwen3.5-MoE and others carry
their MTP head as the last ``<arch>.nextn_predict_layers`` blocks, routed experts included. Read
from the llama.cpp that llama-cpp-python 0.3.36 vendors:

* ``llama_model::load_hparams`` (``llama-model.cpp``) reads ``LLM_KV_NEXTN_PREDICT_LAYERS``
  for every architecture, optional, into ``hparams.n_layer_nextn`` (and asserts it is at most
  ``block_count``);
* ``llama_hparams::n_layer()`` is ``n_layer_all - n_layer_nextn``, and every architecture's
  decoder graph (``src/models/*.cpp``) loops ``il < n_layer``; only the MTP graph
  (``LLM_GRAPH_TYPE_DECODER_MTP``, a context of type ``LLAMA_CONTEXT_TYPE_MTP``, which nothing
  in moepack makes) runs block ``n_layer() + offset``; and the loader skips those blocks'
  tensors unless asked to load them (``load_mtp`` is false by default, ``TENSOR_SKIP``);
* one exception: ``deepseek4`` resets the count to 0 when block ``n_layer()`` has no
  ``nextn.eh_proj`` (``llama_model_deepseek4::load_arch_hparams``), so such a file runs every
  block. (``graniteswitch`` repurposes the count for an attention-only router block of its
  own, after the blocks the metadata's count leaves, which is the same arithmetic here.)

So the trunk llama.cpp runs is the first ``block_count - nextn_predict_layers`` blocks: capture
and check-dropin see routing there only, and the MTP blocks' experts are bytes that repack
may leave in place or permute, and verify checks byte for byte.
"""

from __future__ import annotations

from collections.abc import Collection

from gguf import Keys

NEXTN_KEY = Keys.LLM.NEXTN_PREDICT_LAYERS  # "{arch}.nextn_predict_layers"
_PROBE = "blk.{block}.nextn.eh_proj.weight"
_RESET_WITHOUT_PROBE = frozenset({"deepseek4"})


def blocks_run(arch: str, block_count: int, nextn: int, tensor_names: Collection[str]) -> int:
    """How many leading blocks llama.cpp's decoder graph runs (see the module docstring)."""
    nextn = max(0, min(int(nextn), block_count))
    probe = _PROBE.format(block=block_count - nextn)
    if nextn and arch in _RESET_WITHOUT_PROBE and probe not in tensor_names:
        nextn = 0
    return block_count - nextn
