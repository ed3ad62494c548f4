"""GGUF MoE checkpoints: opening, expert-axis detection, slice geometry, synthetic models."""

from .gguf_file import GgufFile, TensorEntry
from .model import ExpertTensor, MoeBlock, MoeModel

__all__ = ["ExpertTensor", "GgufFile", "MoeBlock", "MoeModel", "TensorEntry"]
