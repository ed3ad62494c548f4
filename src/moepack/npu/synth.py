"""Synthetic ``.q4nx`` files with the 35B's real tensor names, dtypes and shapes.

Tiles are codec-valid (finite positive BF16 scales, integral BF16 zero points 0..15, random
codes), BF16 vectors are finite, and every tensor's bytes depend only on (seed, tensor name)
so a layer reads the same whichever layers a file holds. Generation streams in bounded
chunks: a 21 GB, 40-layer file needs no more memory than a 1-layer one.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import BadInput
from ..filekinds import Q4NX, check_output_kind
from ..keys import GENERATOR, GEOMETRY, SEED
from ..progress import NULL_PROGRESS, ProgressSink
from ..safeio import (
    AtomicOutputs,
    check_destination,
    check_free_space,
    describe_os_error,
    replacing,
)
from .codecs import Q4NX_TILE, Q8_0_TILE, f32_to_bf16
from .geometry import Geometry, parse_layers
from .q4nx import TensorSpec, file_size, write_q4nx

CHUNK_TILES = 2048


@dataclass
class SynthResult:
    path: str
    geometry: str
    layers: list[int]
    tensors: int
    bytes: int
    with_globals: bool


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    words = rng.bit_generator.random_raw(-(-n // 8)).astype(np.uint64, copy=False)
    return words.view(np.uint8)[:n]


def q4nx_tiles(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` random, codec-valid Q4NX tiles."""
    t = _random_bytes(rng, n * Q4NX_TILE).reshape(n, Q4NX_TILE)
    scale = rng.uniform(0.001, 0.02, size=(n, 256)).astype(np.float32)
    zp = rng.integers(0, 16, size=(n, 256)).astype(np.float32)
    t[:, :512] = f32_to_bf16(scale).view(np.uint8).reshape(n, 512)
    t[:, 512:1024] = f32_to_bf16(zp).view(np.uint8).reshape(n, 512)
    return t


def q8_0_tiles(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` random, codec-valid Q8_0 tiles."""
    t = _random_bytes(rng, n * Q8_0_TILE).reshape(n, Q8_0_TILE)
    scale = rng.uniform(0.0005, 0.01, size=(n, 256)).astype(np.float32)
    t[:, :512] = f32_to_bf16(scale).view(np.uint8).reshape(n, 512)
    return t


def produce(spec: TensorSpec, seed: int) -> Iterator[np.ndarray]:
    """The bytes of one synthetic tensor, in chunks."""
    rng = _rng(seed, spec.name)
    if spec.dtype == "I8" and len(spec.shape) == 3 and spec.shape[2] in (Q4NX_TILE, Q8_0_TILE):
        n = spec.shape[0] * spec.shape[1]
        make = q4nx_tiles if spec.shape[2] == Q4NX_TILE else q8_0_tiles
        for i in range(0, n, CHUNK_TILES):
            yield make(rng, min(CHUNK_TILES, n - i))
        return
    count = spec.nbytes // {"BF16": 2, "F32": 4}.get(spec.dtype, 1)
    step = 8 * 1024 * 1024
    norm = spec.name.endswith(("norm.weight", "layernorm.weight"))
    for i in range(0, count, step):
        k = min(step, count - i)
        v = rng.normal(1.0 if norm else 0.0, 0.02, size=k).astype(np.float32)
        if spec.dtype == "BF16":
            yield f32_to_bf16(v)
        elif spec.dtype == "F32":
            yield v
        else:
            yield _random_bytes(rng, k)


def synth(
    out_path: str | os.PathLike[str],
    geometry: str = "scaled",
    layers: str | Sequence[int] | None = "0-3",
    with_globals: bool = False,
    seed: int = 0,
    progress: ProgressSink = NULL_PROGRESS,
    force: bool = False,
) -> SynthResult:
    """Write a synthetic ``.q4nx`` to ``out_path``; an existing file there is replaced only
    with ``force`` (or inside ``safeio.replacing``: it may be a real model)."""
    check_output_kind(out_path, Q4NX)
    with replacing(force):
        check_destination(out_path, ())
        return _synth(out_path, geometry, layers, with_globals, seed, progress)


def _synth(
    out_path: str | os.PathLike[str],
    geometry: str,
    layers: str | Sequence[int] | None,
    with_globals: bool,
    seed: int,
    progress: ProgressSink,
) -> SynthResult:
    geo = Geometry.named(geometry)
    chosen = parse_layers(layers, None, limit=geo.n_layers)
    if not chosen:
        raise BadInput("no layers chosen")
    specs = geo.model_specs(chosen, with_globals)
    meta = {
        GEOMETRY: geo.name,
        GENERATOR: "moepack npu synth",
        SEED: str(seed),
    }
    total = file_size(specs, meta)
    out = Path(out_path)
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise BadInput(f"output folder {str(parent)!r} does not exist", out)
    check_free_space(parent, total, "the synthetic model")
    progress.start(f"synthesising {len(chosen)} layer(s), {geo.name}", total)
    try:
        with AtomicOutputs() as outs:
            fh = outs.open(out)
            write_q4nx(fh, specs, lambda s: produce(s, seed), meta, progress.advance)
    except OSError as e:
        raise describe_os_error(e, out) from None
    finally:
        progress.finish()
    return SynthResult(str(out), geo.name, chosen, len(specs), total, with_globals)
