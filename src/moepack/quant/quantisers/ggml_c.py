"""ggml's own quantisers (``ggml_quantize_chunk`` in libggml-base, bound once in
``moepack.checkpoint.ggml_c``): what llama.cpp's ``llama-quantize`` runs, for every type that
needs no importance matrix."""

from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ...checkpoint.ggml_c import quantise_rows, quantiser_unavailable, requires_imatrix
from ..quantiser import Quantiser

ORDER = 20


class GgmlQuantiser(Quantiser):
    name = "ggml"
    aliases = ("ggml-c",)

    def unavailable_reason(self) -> str | None:
        return quantiser_unavailable()

    def supports(self, qtype: GGMLQuantizationType) -> bool:
        if self.unavailable_reason() is not None or qtype not in GGML_QUANT_SIZES:
            return False
        if qtype in (GGMLQuantizationType.F32,):
            return False
        return not requires_imatrix(qtype)

    def quantize(self, rows: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
        return quantise_rows(rows, qtype)


PLUGIN = GgmlQuantiser()
