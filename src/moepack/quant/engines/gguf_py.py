"""gguf-py's numpy codecs: every type gguf-py dequantises, no native code needed."""

from __future__ import annotations

import numpy as np
from gguf import quants
from gguf.constants import GGMLQuantizationType

from ..engine import DequantEngine

ORDER = 10


class GgufPyEngine(DequantEngine):
    name = "gguf"
    aliases = ("gguf-py",)

    def unavailable_reason(self) -> str | None:
        return None

    def supports(self, qtype: GGMLQuantizationType) -> bool:
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            return True
        return qtype in getattr(quants, "_type_traits", {})

    def dequantize(self, raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
        # bytes that decode to NaN or infinity (a scale of inf times 0) make numpy warn on
        # stderr; they are counted and reported by the caller, as a value like any other
        with np.errstate(all="ignore"):
            out = quants.dequantize(raw, qtype)
        return np.ascontiguousarray(out.reshape(-1), dtype=np.float32)


PLUGIN = GgufPyEngine()
