"""The dequantisation engine interface and its registry.

An engine turns whole quantisation blocks of one ggml type into float32 values. Engines are
a plug-in family (``moepack.quant.engines``): gguf-py's Python codecs and ggml's own C codecs
through ctypes, so any value moepack reports can be checked against the runtime's decoder.
"""

from __future__ import annotations

from abc import abstractmethod

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ..registry import Registry
from .codec import TypeCodec


class DequantEngine(TypeCodec):
    """Dequantises whole blocks of a ggml type (those it ``supports``) into float32."""

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
    if preferred.usable_for(qtype):
        return preferred
    return next((e for e in DEQUANT_ENGINES if e is not preferred and e.usable_for(qtype)), None)
