"""What the two quant plug-in families share: a ggml-type codec that may not run here.

Dequantisation engines and quantisers each handle some ggml types, and each may be missing
what it needs on this machine (ggml's C library, for the ``ggml`` ones); the search for one
that can handle a type is the same in both families.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from gguf.constants import GGMLQuantizationType


class TypeCodec(ABC):
    """A codec of some ggml types: the name users type, and whether it runs here."""

    name: str = ""
    aliases: tuple[str, ...] = ()

    @abstractmethod
    def unavailable_reason(self) -> str | None:
        """Why this codec cannot run here (None when it can)."""

    @abstractmethod
    def supports(self, qtype: GGMLQuantizationType) -> bool:
        """True when this codec handles ``qtype``."""

    def usable_for(self, qtype: GGMLQuantizationType) -> bool:
        """It runs here and handles ``qtype``."""
        return self.unavailable_reason() is None and self.supports(qtype)
