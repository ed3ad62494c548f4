"""gguf-py's numpy quantisers: the types it implements (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16,
BF16), written the way its ``quants.quantize`` writes them."""

from __future__ import annotations

import numpy as np
from gguf import quants
from gguf.constants import GGMLQuantizationType

from ..quantiser import Quantiser

ORDER = 10
# gguf-py quantises these; its K-quant, ternary and MXFP4 classes are left to ggml, the
# runtime's own code, so that every K-quant in a store is what llama.cpp would write.
_TYPES = frozenset(
    {
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q8_0,
    }
)


class GgufPyQuantiser(Quantiser):
    name = "gguf"
    aliases = ("gguf-py",)

    def unavailable_reason(self) -> str | None:
        return None

    def supports(self, qtype: GGMLQuantizationType) -> bool:
        return qtype in _TYPES

    def quantize(self, rows: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
        out = quants.quantize(np.ascontiguousarray(rows, dtype=np.float32), qtype)
        return np.ascontiguousarray(out).view(np.uint8).reshape(-1)


PLUGIN = GgufPyQuantiser()
