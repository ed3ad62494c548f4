"""``moepack survey``: from a Hugging Face ``config.json`` alone, how big each expert slice is
and whether the layout of a checkpoint can matter on this device.

A slice is one expert's share of one matrix: ``hidden x expert_ffn x bits / 8`` bytes; a token
reads ``3 x top_k`` of them per MoE layer (gate, up, down). With a surface, the bound on any
layout's gain is the case where all of a token's slices in a layer are one request:
``(n·t_op + n·s/B) / (t_op + n·s/B)`` with ``n = 3·top_k`` (from the surface's two-parameter
fit). Below ``WORTH_IT`` no layout can pay, whatever the routing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BadInput
from ..inputs import load_json, read_capped
from ..storage.surface import Surface
from .cost import SurfaceFit, fit_surface
from .known_families import KNOWN, KnownFamily

MAX_CONFIG_BYTES = 16 << 20
"""A config.json is a few KiB; anything near this is not one."""

WORTH_IT = 1.05
MATRICES = 3  # gate, up, down


@dataclass(kw_only=True)
class SurveyRow:
    """One family's slice geometry and, with a surface, the most any layout could gain."""

    name: str
    hidden: int
    expert_ffn: int
    experts: int
    top_k: int
    moe_layers: int
    bits: float
    source: str
    fit: SurfaceFit | None = None

    @property
    def slice_bytes(self) -> float:
        return self.hidden * self.expert_ffn * self.bits / 8

    @property
    def bytes_per_token(self) -> float:
        return self.slice_bytes * MATRICES * self.top_k * self.moe_layers

    @property
    def best_gain(self) -> float | None:
        if self.fit is None:
            return None
        n = MATRICES * self.top_k
        stream = n * self.slice_bytes / self.fit.bandwidth
        return (n * self.fit.t_op + stream) / (self.fit.t_op + stream)

    @property
    def verdict(self) -> str:
        g = self.best_gain
        if g is None:
            return "no surface: give `surface` to judge"
        if g < WORTH_IT:
            return f"layout cannot matter (at most {g:.3f}x)"
        return f"layout can matter (up to {g:.2f}x)"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "hidden": self.hidden,
            "expert_ffn": self.expert_ffn,
            "experts": self.experts,
            "top_k": self.top_k,
            "moe_layers": self.moe_layers,
            "bits": self.bits,
            "slice_kib": self.slice_bytes / 1024,
            "bytes_per_token": self.bytes_per_token,
            "best_gain": self.best_gain,
            "verdict": self.verdict,
            "source": self.source,
        }


@dataclass
class SurveyResult:
    rows: list[SurveyRow]
    fit: SurfaceFit | None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "fit": self.fit.to_json() if self.fit else None,
            "rows": [r.to_json() for r in self.rows],
            "notes": self.notes,
        }


def _first(cfg: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for k in keys:
        if k in cfg:
            return cfg[k]
    return None


def family_from_config(path: str | os.PathLike[str]) -> KnownFamily:
    """The MoE geometry a config.json states (its ``text_config`` for multimodal ones)."""
    p = Path(path)
    doc = load_json(read_capped(p, "config file", MAX_CONFIG_BYTES), p, "config file")
    if not isinstance(doc, dict):
        raise BadInput("config.json must hold a JSON object", p)
    cfg = doc.get("text_config") if isinstance(doc.get("text_config"), dict) else doc
    assert isinstance(cfg, dict)
    experts = _first(cfg, ("num_experts", "num_local_experts", "n_routed_experts"))
    if not experts:
        raise BadInput(
            "config has no expert count (num_experts / num_local_experts / "
            "n_routed_experts): not a MoE model",
            p,
        )
    values = {
        "hidden_size": _first(cfg, ("hidden_size", "d_model")),
        "expert ffn (moe_intermediate_size / intermediate_size)": _first(
            cfg, ("moe_intermediate_size", "intermediate_size")
        ),
        "num_experts_per_tok": _first(cfg, ("num_experts_per_tok", "experts_per_token")),
        "num_hidden_layers": _first(cfg, ("num_hidden_layers", "num_layers")),
        "num_experts": experts,
    }
    for key, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise BadInput(f"config field {key} is missing or not a positive integer", p)
    hidden, ffn, top_k, layers, n_expert = values.values()
    dense = cfg.get("first_k_dense_replace", 0) or 0
    if not isinstance(dense, int) or isinstance(dense, bool) or dense < 0:
        raise BadInput("config field first_k_dense_replace is not a non-negative integer", p)
    archs = doc.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    name = str(doc.get("_name_or_path") or arch or p.parent.name)
    return KnownFamily(name, hidden, ffn, n_expert, top_k, layers, dense, str(p))


def survey(
    configs: list[str | os.PathLike[str]],
    known: bool = False,
    bits: float = 4.5,
    surface: Surface | str | os.PathLike[str] | None = None,
    queue_depth: int = 1,
) -> SurveyResult:
    """Slice sizes (and with a surface, the bound on any layout's gain) of each config."""
    if not configs and not known:
        raise BadInput("give a config.json, or `known` for the built-in table")
    if not 1 <= bits <= 32:
        raise BadInput(f"`bits` must be between 1 and 32, got {bits}")
    if surface is not None and not isinstance(surface, Surface):
        surface = Surface.load(surface)
    fit = fit_surface(surface, queue_depth) if surface is not None else None
    families = [family_from_config(c) for c in configs] + (list(KNOWN) if known else [])
    rows = [
        SurveyRow(
            name=f.name,
            hidden=f.hidden,
            expert_ffn=f.expert_ffn,
            experts=f.experts,
            top_k=f.top_k,
            moe_layers=f.layers - f.dense_layers,
            bits=bits,
            source=f.source,
            fit=fit,
        )
        for f in families
    ]
    notes = [] if fit else ["no surface: only slice sizes, no verdict on this device"]
    return SurveyResult(rows, fit, notes)
