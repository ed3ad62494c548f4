"""The dequantisation engine interface and its registry.

An engine turns whole quantisation blocks of one ggml type into float32 values. Engines are
a plug-in family (``moepack.quant.engines``): gguf-py's Python codecs and ggml's own C codecs
through ctypes, so any value moepack reports can be checked against the runtime's decoder.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ..registry import Registry


class DequantEngine(ABC):
    """Dequantises whole blocks of a ggml type into float32."""

    name: str = ""
    aliases: tuple[str, ...] = ()

    @abstractmethod
    def unavailable_reason(self) -> str | None:
        """Why this engine cannot run here (None when it can)."""

    @abstractmethod
    def supports(self, qtype: GGMLQuantizationType) -> bool:
        """True when this engine dequantises ``qtype``."""

    @abstractmethod
    def dequantize(self, raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
        """The float32 values of ``raw`` (uint8, a whole number of ``qtype`` blocks)."""


def values_in(qtype: GGMLQuantizationType, n_bytes: int) -> int:
    """How many values ``n_bytes`` of whole ``qtype`` blocks hold."""
    block, size = GGML_QUANT_SIZES[qtype]
    return n_bytes // size * block


DEQUANT_ENGINES: Registry[DequantEngine] = Registry(
    "dequantisation engine", "moepack.quant.engines", DequantEngine, every_module=True
)


def engine_for(qtype: GGMLQuantizationType, preferred: DequantEngine) -> DequantEngine | None:
    """``preferred`` when it knows ``qtype``, else any other available engine that does."""
    if preferred.unavailable_reason() is None and preferred.supports(qtype):
        return preferred
    for other in DEQUANT_ENGINES:
        if other is not preferred and other.unavailable_reason() is None and other.supports(qtype):
            return other
    return None
