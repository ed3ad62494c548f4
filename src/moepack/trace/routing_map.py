"""The routing gate over two captured traces: a repacked file's expert ids, mapped back
through the permutation it records, must be the original's on every (token, layer).

A repack only relabels experts, so llama.cpp must choose the same real experts; this is the
check that the relabelling in the file and the bytes moved agree, read off llama.cpp itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checkpoint.model import MoeModel
from ..checkpoint.provenance import read_provenance
from ..errors import BadInput
from .core import RoutingTrace, token_chunks


@dataclass
class RoutingAgreement:
    """Shares of (token, layer) cells whose mapped-back ids equal the original's."""

    tokens: int
    cells: int
    same_set: float
    same_order: float

    @property
    def ok(self) -> bool:
        return self.same_set == 1.0 and self.same_order == 1.0

    def to_json(self) -> dict[str, object]:
        return {
            "tokens": self.tokens,
            "cells": self.cells,
            "same_set": self.same_set,
            "same_order": self.same_order,
            "ok": self.ok,
        }


def routing_maps_back(
    original: RoutingTrace, candidate: RoutingTrace, candidate_path: str | os.PathLike[str]
) -> RoutingAgreement:
    """Compare the routing of the same tokens through ORIGINAL and CANDIDATE (its permutation
    read from ``candidate_path``), in bounded chunks of rows."""
    if original.ids.shape != candidate.ids.shape or original.block_map != candidate.block_map:
        raise BadInput(
            f"the two captures differ in shape: {original.ids.shape} vs {candidate.ids.shape}",
            candidate_path,
        )
    with MoeModel(Path(candidate_path)) as m:
        prov = read_provenance(m)
    n = original.n_expert
    blocks = original.block_map or list(range(original.layers))
    perms = [prov.perm(b, n) if prov is not None else np.arange(n, dtype=np.int64) for b in blocks]
    same_set = same_order = 0
    row_cells = original.layers * original.k
    for rows in token_chunks(original.tokens, row_cells):
        for layer, perm in enumerate(perms):
            mapped = np.asarray(perm)[np.asarray(candidate.ids[rows, layer], dtype=np.int64)]
            orig = np.asarray(original.ids[rows, layer], dtype=np.int64)
            same_order += int(np.all(mapped == orig, axis=1).sum())
            same_set += int(np.all(np.sort(mapped, axis=1) == np.sort(orig, axis=1), axis=1).sum())
    cells = original.tokens * original.layers
    return RoutingAgreement(original.tokens, cells, same_set / cells, same_order / cells)
