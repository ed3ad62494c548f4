"""The values of a synthetic model's tensors, before quantisation.

Every tensor draws from its own generator, seeded by (seed, tensor name), so any tensor can be
regenerated alone and in any order. Large tensors are drawn a chunk of rows at a time from that
one generator: the chunks, laid end to end, are the very values of the tensor drawn whole
(numpy's generators continue a stream across calls), so memory stays a chunk and the values
stay those of every model written before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from .routing import (
    BIAS_SCALE,
    DAMP,
    ROUTER_BIASES,
    damped,
    embedding_values,
    router_values,
    routing_plan,
)

if TYPE_CHECKING:
    from .archs import TensorPlan
    from .synth import SynthSpec

# Roles drawn a chunk at a time (the others are small, or planted whole).
_STREAMED = frozenset({"matrix", "experts"})


def named_rng(seed: int, name: str) -> np.random.Generator:
    """The generator of the stream called ``name`` in a model of ``seed``."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def _planted(spec: SynthSpec, name: str, role: str) -> bool:
    """Values planted whole by the routing (the embedding and the planted routers)."""
    if spec.routing is None:
        return False
    if name == "token_embd.weight":
        return True
    block = name.split(".")[1] if name.startswith("blk.") else ""
    return (
        role == "router"
        and name.endswith(".ffn_gate_inp.weight")
        and int(block) in routing_plan(spec).blocks
    )


def tensor_values(spec: SynthSpec, name: str, shape: tuple[int, ...], role: str) -> np.ndarray:
    """The values of tensor ``name`` in the model ``spec`` describes (before quantisation):
    the planted embedding and router where the spec plants routing, seeded noise otherwise."""
    if _planted(spec, name, role):
        if name == "token_embd.weight":
            return embedding_values(spec)
        return router_values(spec, int(name.split(".")[1]))
    x = _random_values(spec, name, shape, role)
    if spec.routing is not None and (damped(name) or name.endswith(ROUTER_BIASES)):
        x *= np.float32(DAMP if damped(name) else BIAS_SCALE)
    return x


def _random_values(spec: SynthSpec, name: str, shape: tuple[int, ...], role: str) -> np.ndarray:
    rng = named_rng(spec.seed, name)
    if role in ("bias", "expert_bias"):
        return (0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if role == "norm":
        return (1.0 + 0.05 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if role == "router":
        return (0.5 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if role == "decay":  # a delta-net's -exp(A_log): negative, so every state decays
        return (-0.5 - rng.random(shape, dtype=np.float32)).astype(np.float32)
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= _std(shape)
    if role == "experts":
        x *= _expert_scales(shape)[:, None, None]
    return x


def _std(shape: tuple[int, ...]) -> np.float32:
    return np.float32(1.0 / np.sqrt(shape[-1]))


def _expert_scales(shape: tuple[int, ...]) -> np.ndarray:
    """Each expert its own scale: no two expert slices are alike, even after quantisation."""
    return (1.0 + 0.5 * np.arange(shape[0], dtype=np.float32) / shape[0]).astype(np.float32)


def value_chunks(spec: SynthSpec, tensor: TensorPlan, max_values: int) -> Iterator[np.ndarray]:
    """The values of ``tensor`` as consecutive blocks of whole rows (2-D, F32) of at most
    ``max_values`` values each (one row when a row is longer): ``tensor_values`` in pieces."""
    shape = tensor.shape
    cols = shape[-1]
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    step = max(1, max_values // cols)
    if tensor.role not in _STREAMED or _planted(spec, tensor.name, tensor.role):
        whole = tensor_values(spec, tensor.name, shape, tensor.role).reshape(rows, cols)
        for r in range(0, rows, step):
            yield whole[r : r + step]
        return
    rng = named_rng(spec.seed, tensor.name)
    std = _std(shape)
    scales = _expert_scales(shape) if tensor.role == "experts" else None
    per_expert = rows // shape[0] if scales is not None else 1
    damp = spec.routing is not None and damped(tensor.name)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        x = rng.standard_normal((n, cols), dtype=np.float32)
        x *= std
        if scales is not None:
            x *= scales[np.arange(r, r + n) // per_expert][:, None]
        if damp:
            x *= np.float32(DAMP)
        yield x
