"""Helpers shared by the test suites: small real GGUF files written with gguf-py (no
committed binaries), and the CLI run in process."""

from __future__ import annotations

import os
import struct
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from gguf import GGUFWriter

from moepack.checkpoint import MoeModel
from moepack.checkpoint.gguf_file import GgufFile
from moepack.checkpoint.synth import SynthSpec
from moepack.cli.main import main
from moepack.layout.plan import LayerPlan, Plan
from moepack.rewrite.verify import verify


def run_cli(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    """Run ``moepack ARGS`` in process through the real entry point (its error handling
    included); return the exit code, stdout and stderr. Arguments are turned into strings."""
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def tiny_spec(**kw: object) -> SynthSpec:
    """A qwen3moe spec small enough for thousands of verifications, still llama.cpp-loadable."""
    base: dict[str, Any] = dict(
        layers=2,
        experts=8,
        top_k=2,
        hidden=64,
        expert_ffn=32,
        heads=2,
        kv_heads=1,
        head_dim=32,
        vocab=262,
    )
    base.update(kw)
    return SynthSpec(**base)


def write_gguf(
    path: Path,
    arch: str,
    tensors: dict[str, tuple[int, ...]],
    kv: Mapping[str, object] | None = None,
    seed: int = 0,
    dtype: type = np.float32,
) -> Path:
    """A GGUF with the given tensors (numpy shapes, i.e. reversed ggml ne) of random values.

    ``kv`` values: int -> u32, float -> f32, str -> string, list[int] -> u32 array."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, arch)
    for key, value in (kv or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, list(cast(Iterable[Any], value)))
    for name, shape in tensors.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def metadata_entries(path: Path) -> list[tuple[str, bytes]]:
    """A GGUF's metadata entries as (key, raw bytes), in file order."""
    g = GgufFile(path)
    return [(k, g.raw_kv(k)) for k in sorted(g.kv, key=lambda k: g.kv[k].start)]


def craft_metadata(src: Path, dst: Path, kvs: list[bytes]) -> Path:
    """``src`` with its metadata entries replaced by ``kvs`` (tensor infos and data kept)."""
    g = GgufFile(src)
    raw = src.read_bytes()
    infos = raw[min(t.info_start for t in g.tensors) : g.header_end]
    head = raw[:8] + struct.pack("<QQ", len(g.tensors), len(kvs)) + b"".join(kvs) + infos
    dst.write_bytes(head + bytes((-len(head)) % g.alignment) + raw[g.data_offset :])
    return dst


def ambiguous_model(path: Path) -> Path:
    """A 4-expert MoE block with an unknown tensor whose outermost dimension is the expert
    count (``blk.0.ffn_odd.weight``): moepack must report it, not guess."""
    n, f, e = 32, 32, 4
    return write_gguf(
        path,
        "qwen3moe",
        {
            "blk.0.ffn_gate_inp.weight": (e, n),
            "blk.0.ffn_up_exps.weight": (e, f, n),
            "blk.0.ffn_down_exps.weight": (e, n, f),
            "blk.0.ffn_odd.weight": (e, 8),
        },
        {"qwen3moe.expert_count": e, "qwen3moe.expert_used_count": 2},
    )


def synth_with_trace(
    capsys: pytest.CaptureFixture[str], folder: Path, *options: object
) -> tuple[Path, Path]:
    """``moepack synth`` a small model and its trace into ``folder`` through the CLI
    (16 experts, top-4 unless ``options`` say otherwise); returns (model, trace)."""
    model, trace = folder / "m.gguf", folder / "t.moetrace"
    code, _, err = run_cli(
        capsys, "synth", "--out", model, "--trace-out", trace, "--experts", "16", "--top-k", "4",
        *options, "-q",
    )  # fmt: skip
    assert code == 0, err
    return model, trace


def flip_range(args: tuple[str, str, int, int, tuple[int, ...]]) -> list[tuple[int, int]]:
    """Flip each byte of [start, stop) in turn with each mask; return (offset, mask) pairs
    whose flip still verified."""
    original, repacked, start, stop, masks = args
    data = bytearray(Path(repacked).read_bytes())
    passed = []
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        bad = Path(d) / "flipped.gguf"
        for i in range(start, stop):
            for mask in masks:
                data[i] ^= mask
                bad.write_bytes(data)
                data[i] ^= mask
                if verify(original, bad).ok:
                    passed.append((i, mask))
    return passed


def grouped_plan(model: MoeModel, seed: int) -> Plan:
    """A random permutation of every MoE block that keeps each expert in its routing group."""
    rng = np.random.default_rng(seed)
    g = max(model.n_expert_group, 1)
    layers = []
    for b in model.blocks:
        per = b.n_expert // g
        perm = np.concatenate([rng.permutation(per) + i * per for i in range(g)])
        assert b.violation(perm) is None
        layers.append(LayerPlan(b.index, perm))
    return Plan(layers, model.fingerprint)


REPLY = "Hi!"


def replying_model(path: Path, arch: str = "qwen3moe", reply: str = REPLY, **kw: object) -> Path:
    """A synthetic F32 model of ``arch`` that answers any prompt with ``reply`` and then its
    end-of-sequence token, at any temperature an API samples at: a chat client's conformance
    checks need a model that stops by itself (``finish_reason`` "stop") with some text.

    Each of ``reply``'s bytes (distinct, so each has one successor) is a byte token with a
    direction of the hidden state of its own; every other token shares direction 0. The
    embedding puts a large value in its token's direction, so the last hidden state still
    points there after the (small) layers; the output norm keeps only those directions, and
    the output matrix maps each direction to the next token of ``(any) -> reply... -> EOS``
    with a logit margin no sampler overcomes."""
    from gguf import GGUFReader

    from moepack.checkpoint.synth import synth_model

    chain = [3 + b for b in reply.encode("utf-8")]  # the byte tokens <0xXX> follow 3 specials
    assert len(set(chain)) == len(chain), "a reply token repeated would have two successors"
    spec = tiny_spec(arch=arch, **kw)
    assert len(chain) + 1 <= spec.hidden
    out = synth_model(path, spec).paths[0]
    reader = GGUFReader(out, "r+")
    tensors = {t.name: t.data for t in reader.tensors}
    embd, norm, head = (
        tensors["token_embd.weight"],
        tensors["output_norm.weight"],
        tensors["output.weight"],
    )
    assert embd.dtype == np.float32 and head.dtype == np.float32
    direction = np.zeros(spec.vocab, dtype=np.int64)
    for i, token in enumerate(chain):
        direction[token] = i + 1
    embd *= np.float32(0.05)
    embd[np.arange(spec.vocab), direction] += np.float32(50.0)
    norm[:] = 0
    norm[: len(chain) + 1] = 1
    head[:] = 0
    for i, token in enumerate([*chain, 2]):  # token i follows direction i; EOS (2) ends it
        head[token, i] = 20.0
    reader.data.flush()
    del reader, tensors, embd, norm, head
    return out
