"""The quantiser interface and its registry: float32 rows into whole blocks of a ggml type.

Quantisers are a plug-in family (``moepack.quant.quantisers``): gguf-py's numpy quantisers
(Q4_0 … Q8_0, F16, BF16) and ggml's own ``ggml_quantize_chunk`` through ctypes for the types
gguf-py has no quantiser for (the K-quants). ``quantiser_for`` picks gguf-py where it can and
ggml otherwise, so a requantisation is reproducible from the quantiser's name alone.
"""

from __future__ import annotations

from abc import abstractmethod

import numpy as np
from gguf.constants import GGMLQuantizationType

from ..errors import BadInput
from ..registry import Registry
from .codec import TypeCodec


class Quantiser(TypeCodec):
    """Quantises float32 rows (``[rows, n_per_row]``) into whole blocks of a ggml type (those
    it ``supports``: the ones it writes without an importance matrix)."""

    @abstractmethod
    def quantize(self, rows: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
        """The bytes (uint8) of ``rows`` (float32, C-contiguous) quantised to ``qtype``."""


QUANTISERS: Registry[Quantiser] = Registry(
    "quantiser", "moepack.quant.quantisers", Quantiser, every_module=True
)


def quantiser_for(qtype: GGMLQuantizationType) -> Quantiser:
    """The first available quantiser (in registry order: gguf-py, then ggml) for ``qtype``;
    ``BadInput`` saying why when none can write it."""
    reasons = []
    for q in QUANTISERS:
        why = q.unavailable_reason()
        if why is None and q.supports(qtype):
            return q
        reasons.append(f"{q.name}: {why or 'does not write it'}")
    raise BadInput(f"no quantiser writes {qtype.name} here ({'; '.join(reasons)})")
