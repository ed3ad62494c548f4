"""Synthetic checkpoints of real MoE architectures that llama.cpp loads and runs.

The families (``qwen3moe``, ``deepseek2``, …) are plug-ins in ``moepack.checkpoint.archs``:
each says which tensors and metadata its llama.cpp loader wants; ``synth_values`` draws the
values, ``synth_plan`` fixes every tensor's type and place (and so the file's exact size), and
``synth_write`` writes them, tensor by tensor, on every core. Weights are random but
deterministic per (seed, tensor name), so any tensor can be regenerated alone, and every
expert slice differs from every other (each expert also gets its own scale), so a wrong
permutation can never pass a byte comparison. Memory is a chunk of rows per worker, not the
model.

The direct types (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) put every tensor in that one
type. llama.cpp's file types (Q4_K_M, Q6_K, …, MXFP4_MOE) take llama.cpp's own per-tensor
mix (``ftypes``), quantised by ggml's own quantiser: the bytes ``llama_model_quantize`` makes
of the F32 model. Norms, biases and the router stay F32, as llama.cpp keeps them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from gguf.constants import GGML_QUANT_SIZES

from ..errors import BadInput, MoepackError
from ..filekinds import GGUF, check_output_kind
from ..progress import NULL_PROGRESS, ProgressSink
from ..safeio import AtomicOutputs, check_destination, check_free_space, describe_os_error
from .archs import SynthArch, get_arch
from .ftypes import LLAMA_FTYPES
from .llama_quantize import llama_cpp_available
from .routing import CJK_CHARS, FIRST_WORD, RoutingSpec
from .synth_plan import DIRECT_TYPES, plan_synth, tensor_types
from .synth_write import default_threads, encoder_missing, write_synth

ARCH = "qwen3moe"  # the default family
WEIGHT_TYPES = tuple(DIRECT_TYPES) + tuple(LLAMA_FTYPES)


@dataclass(frozen=True)
class SynthSpec:
    """Size knobs of a synthetic MoE model. Defaults: a ~27 MB F32 qwen3moe model.

    The fields after ``with_output`` are family options; ``None`` means the family's default
    (see its module in ``moepack.checkpoint.archs``), and a family refuses options it has no
    place for."""

    layers: int = 2
    experts: int = 16
    top_k: int = 4
    hidden: int = 256
    expert_ffn: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    vocab: int = 320
    context: int = 512
    weight_type: str = "F32"
    seed: int = 0
    with_output: bool = True
    arch: str = ARCH
    shared_experts: int | None = None
    expert_groups: int | None = None
    groups_used: int | None = None
    dense_layers: int | None = None
    fused_gate_up: bool = False
    nextn_layers: int | None = None  # multi-token-prediction blocks at the end (glm4moe: 1)
    routing: RoutingSpec | None = None  # planted routing (see moepack.checkpoint.routing)
    dense_ffn: int | None = None  # FFN width of the dense leading blocks (default expert-ffn)
    linear_heads: int | None = None  # delta-net value heads (default heads)
    linear_key_heads: int | None = None  # delta-net key heads (default kv-heads)
    linear_head_dim: int | None = None  # delta-net head width (default head-dim)

    @property
    def family(self) -> SynthArch:
        return get_arch(self.arch)

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise BadInput(f"synthetic model spec: {msg}")

        family = self.family
        for f in fields(self):
            if f.name in _FAMILY_OPTIONS and getattr(self, f.name) != f.default:
                need(
                    f.name in family.options,
                    f"{f.name.replace('_', '-')} is not an option of {family.name}",
                )
        need(self.layers >= 1, "layers must be >= 1")
        need(self.experts >= 2, "experts must be >= 2")
        need(1 <= self.top_k <= self.experts, "top-k must be between 1 and the expert count")
        need(self.hidden >= 32 and self.expert_ffn >= 32, "hidden and expert-ffn must be >= 32")
        need(self.heads >= 1 and self.kv_heads >= 1, "heads must be >= 1")
        need(self.heads % self.kv_heads == 0, "heads must be a multiple of kv-heads")
        need(self.head_dim >= 2 and self.head_dim % 2 == 0, "head-dim must be even")
        need(self.vocab >= 259 + 3, "vocab must hold the 259 special and byte tokens plus some")
        need(self.context >= 8, "context must be >= 8")
        need(
            self.nextn_layers is None or self.nextn_layers >= 0,
            "next-token-prediction layers must be >= 0",
        )
        need(self.dense_ffn is None or self.dense_ffn >= 32, "dense-ffn must be >= 32")
        need(
            self.weight_type in WEIGHT_TYPES,
            f"weight type must be one of {', '.join(WEIGHT_TYPES)}",
        )
        family.check(self)
        if self.routing is not None:
            self.routing.check(self.experts, self.top_k, family.expert_groups(self))
            topics = self.experts // self.routing.cluster_size
            need(
                2 * topics <= self.vocab - FIRST_WORD <= CJK_CHARS,
                f"routing needs at least 2 words per topic and one character per word: "
                f"vocab between {FIRST_WORD + 2 * topics} and {FIRST_WORD + CJK_CHARS}",
            )
        if self.weight_type in DIRECT_TYPES:  # llama.cpp's mixes fall back where rows are odd
            for t, qtype in tensor_types(self):
                block = GGML_QUANT_SIZES[qtype][0]
                need(
                    t.shape[-1] % block == 0,
                    f"{t.name} rows of {t.shape[-1]} are not a multiple of {block} "
                    f"for {self.weight_type}",
                )

    def recorded(self) -> dict[str, object]:
        """The spec as stored in the model (``moepack.synth.spec``): family options left at
        their defaults are omitted, so a default qwen3moe model records what it always did."""
        out = asdict(self)
        for f in fields(self):
            if f.name in _RECORDED_WHEN_SET and out[f.name] == f.default:
                del out[f.name]
        return out


# SynthSpec fields that belong to families (a family refuses those it has no place for).
_FAMILY_OPTIONS = frozenset(
    {
        "shared_experts",
        "expert_groups",
        "groups_used",
        "dense_layers",
        "fused_gate_up",
        "nextn_layers",
        "dense_ffn",
        "linear_heads",
        "linear_key_heads",
        "linear_head_dim",
    }
)
# Fields newer than the first qwen3moe models: recorded only when they differ from the default.
_RECORDED_WHEN_SET = _FAMILY_OPTIONS | {"arch", "routing"}


@dataclass(frozen=True)
class SynthModelResult:
    paths: list[Path]
    spec: SynthSpec
    file_bytes: int
    tensors: int
    types: dict[str, int]  # tensors of each type (llama.cpp's mix for its file types)

    def to_json(self) -> dict[str, object]:
        return {
            "paths": [str(p) for p in self.paths],
            "spec": asdict(self.spec),
            "file_bytes": self.file_bytes,
            "tensors": self.tensors,
            "types": self.types,
        }


def writer_missing(spec: SynthSpec) -> str | None:
    """Why this machine cannot write ``spec`` (ggml's quantiser is missing), or None."""
    return encoder_missing({qtype for _, qtype in tensor_types(spec)})


def synth_model(
    out: str | os.PathLike[str],
    spec: SynthSpec = SynthSpec(),
    split_max_size: int = 0,
    progress: ProgressSink = NULL_PROGRESS,
    companions: Callable[[Path, Path], list[tuple[Path, Path]]] | None = None,
    threads: int | None = None,
) -> SynthModelResult:
    """Write a synthetic GGUF of ``spec.arch`` to ``out`` (split into shards of at most
    ``split_max_size`` bytes when non-zero; shards are named ``STEM-0000i-of-0000N.gguf``),
    with ``threads`` workers (default: every core).

    ``companions(staged_model, staging_dir)`` may write files made from the staged model (a
    routing trace) into ``staging_dir`` and return ``(staged, final)`` pairs: they are switched
    into place together with the model (``AtomicOutputs``), so either everything appears or
    nothing does."""
    plan = plan_synth(spec, split_max_size)
    dest = check_destination(check_output_kind(out, GGUF), ())
    if dest.suffix != ".gguf":
        raise BadInput("output name must end in .gguf", dest)
    missing = writer_missing(spec)
    if missing is not None:
        raise MoepackError(f"cannot write {spec.weight_type}: {missing}")
    check_free_space(dest.parent, plan.file_bytes, "the synthetic model")
    try:
        with AtomicOutputs() as outs:  # the shards and companions appear together or not at all
            staging = outs.staged_dir(dest.parent)  # gguf-py names its shards
            files = write_synth(
                spec,
                plan,
                staging / dest.name,
                split_max_size,
                progress,
                threads or default_threads(),
            )
            finals = [dest.parent / f.name for f in files]
            extra = companions(files[0], staging) if companions is not None else []
            for staged, final in list(zip(files, finals, strict=True)) + extra:
                outs.adopt(staged, final)
    except OSError as e:
        raise describe_os_error(e, dest) from None
    return SynthModelResult(
        paths=finals,
        spec=spec,
        file_bytes=sum(p.stat().st_size for p in finals),
        tensors=len(plan.tensors),
        types=plan.type_counts(),
    )


__all__ = [
    "ARCH",
    "DIRECT_TYPES",
    "LLAMA_FTYPES",
    "WEIGHT_TYPES",
    "SynthModelResult",
    "SynthSpec",
    "llama_cpp_available",
    "synth_model",
    "writer_missing",
]
