"""Synthetic checkpoints of real MoE architectures that llama.cpp loads and runs.

The families (``qwen3moe``, ``deepseek2``, …) are plug-ins in ``moepack.checkpoint.archs``:
each says which tensors and metadata its llama.cpp loader wants; this module draws the values
and writes the file. Weights are random but deterministic per (seed, tensor name), so any
tensor can be regenerated alone, and every expert slice differs from every other (each expert
also gets its own scale), so a wrong permutation can never pass a byte comparison. Writing
streams one tensor at a time: memory is bounded by the largest tensor, not the model.

Types gguf-py can quantise (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) are written directly.
K-quants (Q4_K_M, Q6_K, …) are produced the way users produce them: an F32 model quantised by
llama.cpp's ``llama_model_quantize`` (in a subprocess, so a llama.cpp abort cannot take us down).
Norms, biases and the router stay F32, as llama.cpp keeps them.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

from ..errors import BadInput, MoepackError
from ..filekinds import GGUF, check_output_kind
from ..keys import SYNTH_ROUTING, SYNTH_SPEC
from ..progress import NULL_PROGRESS, ProgressSink
from ..safeio import AtomicOutputs, check_destination, check_free_space, describe_os_error
from .archs import F32_ROLES, SynthArch, TensorPlan, get_arch
from .routing import (
    BIAS_SCALE,
    CJK_CHARS,
    DAMP,
    FIRST_WORD,
    ROUTER_BIASES,
    RoutingSpec,
    damped,
    embedding_values,
    record,
    router_values,
    routing_plan,
    routing_vocab,
)

ARCH = "qwen3moe"  # the default family

# Types gguf-py quantises itself.
DIRECT_TYPES = {
    "F32": GGMLQuantizationType.F32,
    "F16": GGMLQuantizationType.F16,
    "BF16": GGMLQuantizationType.BF16,
    "Q8_0": GGMLQuantizationType.Q8_0,
    "Q4_0": GGMLQuantizationType.Q4_0,
    "Q4_1": GGMLQuantizationType.Q4_1,
    "Q5_0": GGMLQuantizationType.Q5_0,
    "Q5_1": GGMLQuantizationType.Q5_1,
}
# llama.cpp file types (llama_ftype) for the K-quants, quantised by llama.cpp itself.
LLAMA_FTYPES = {
    "Q2_K": 10,
    "Q3_K_S": 11,
    "Q3_K_M": 12,
    "Q3_K_L": 13,
    "Q4_K_S": 14,
    "Q4_K_M": 15,
    "Q5_K_S": 16,
    "Q5_K_M": 17,
    "Q6_K": 18,
}
WEIGHT_TYPES = tuple(DIRECT_TYPES) + tuple(LLAMA_FTYPES)
_FILE_TYPES = {
    GGMLQuantizationType.F32: LlamaFileType.ALL_F32,
    GGMLQuantizationType.F16: LlamaFileType.MOSTLY_F16,
    GGMLQuantizationType.BF16: LlamaFileType.MOSTLY_BF16,
    GGMLQuantizationType.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    GGMLQuantizationType.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    GGMLQuantizationType.Q4_1: LlamaFileType.MOSTLY_Q4_1,
    GGMLQuantizationType.Q5_0: LlamaFileType.MOSTLY_Q5_0,
    GGMLQuantizationType.Q5_1: LlamaFileType.MOSTLY_Q5_1,
}


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
        need(
            self.weight_type in WEIGHT_TYPES,
            f"weight type must be one of {', '.join(WEIGHT_TYPES)}",
        )
        block = 256 if self.weight_type in LLAMA_FTYPES else _block_size(self.weight_type)
        for name, width in (("hidden", self.hidden), ("expert-ffn", self.expert_ffn)):
            need(
                width % block == 0,
                f"{name} {width} must be a multiple of {block} for {self.weight_type} rows",
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
        if self.weight_type in DIRECT_TYPES and block > 1:
            for t in family.tensors(self):
                need(
                    t.stored_f32 or t.shape[-1] % block == 0,
                    f"{t.name} rows of {t.shape[-1]} are not a multiple of {block} "
                    f"for {self.weight_type}",
                )

    def estimated_bytes(self) -> int:
        """Bytes of the F32 model (the largest intermediate we write)."""
        elements = sum(int(np.prod(t.shape)) for t in self.family.tensors(self))
        return 4 * elements + 64 * 1024 * 1024

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
    }
)
# Fields newer than the first qwen3moe models: recorded only when they differ from the default.
_RECORDED_WHEN_SET = _FAMILY_OPTIONS | {"arch", "routing"}


def _block_size(type_name: str) -> int:
    return GGML_QUANT_SIZES[DIRECT_TYPES[type_name]][0]


@dataclass(frozen=True)
class SynthModelResult:
    paths: list[Path]
    spec: SynthSpec
    file_bytes: int
    tensors: int

    def to_json(self) -> dict[str, object]:
        return {
            "paths": [str(p) for p in self.paths],
            "spec": asdict(self.spec),
            "file_bytes": self.file_bytes,
            "tensors": self.tensors,
        }


def _rng(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def _vocab(vocab: int, routing: bool = False) -> tuple[list[bytes], list[float], list[int]]:
    """An SPM ("llama") vocabulary: <unk> <s> </s>, 256 byte tokens, then word pieces (for
    routing models, pieces that prompt text round-trips through)."""
    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    if routing:
        words = routing_vocab(vocab)
        scores = [0.0] * 259 + [-float(j) for j in range(len(words))]
        return (
            tokens + words,
            scores,
            [int(t) for t in types] + [int(TokenType.NORMAL)] * len(words),
        )
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    while len(tokens) < vocab:
        a, b = divmod(i, len(letters))
        piece = (
            ("\u2581" if i % 2 == 0 else "")
            + letters[b]
            + (letters[a % 26] * (a // 26 + 1) if a else "")
        )
        tokens.append(piece.encode("utf-8"))
        types.append(TokenType.NORMAL)
        i += 1
    scores = [0.0] * 3 + [0.0] * 256 + [-float(j) for j in range(vocab - 259)]
    return tokens, scores, [int(t) for t in types]


def _tensor_plan(spec: SynthSpec) -> list[TensorPlan]:
    """Every tensor of the model, in file order (the family decides)."""
    return spec.family.tensors(spec)


def tensor_values(spec: SynthSpec, name: str, shape: tuple[int, ...], role: str) -> np.ndarray:
    """The values of tensor ``name`` in the model ``spec`` describes (before quantisation):
    the planted embedding and router where the spec plants routing, seeded noise otherwise."""
    if spec.routing is not None:
        if name == "token_embd.weight":
            return embedding_values(spec)
        block = name.split(".")[1] if name.startswith("blk.") else ""
        if (
            role == "router"
            and name.endswith(".ffn_gate_inp.weight")
            and int(block) in routing_plan(spec).blocks
        ):
            return router_values(spec, int(block))
        if damped(name) or name.endswith(ROUTER_BIASES):
            x = _random_values(spec, name, shape, role)
            x *= np.float32(DAMP if damped(name) else BIAS_SCALE)
            return x
    return _random_values(spec, name, shape, role)


def _random_values(spec: SynthSpec, name: str, shape: tuple[int, ...], role: str) -> np.ndarray:
    rng = _rng(spec.seed, name)
    if role in ("bias", "expert_bias"):
        return (0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if role == "norm":
        return (1.0 + 0.05 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if role == "router":
        return (0.5 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if role == "decay":  # a delta-net's -exp(A_log): negative, so every state decays
        return (-0.5 - rng.random(shape, dtype=np.float32)).astype(np.float32)
    fan_in = shape[-1]
    std = np.float32(1.0 / np.sqrt(fan_in))
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= std
    if role == "experts":
        # each expert its own scale: no two expert slices are alike, even after quantisation
        x *= (1.0 + 0.5 * np.arange(shape[0], dtype=np.float32) / shape[0])[:, None, None]
    return x


def _stored(
    arr: np.ndarray, role: str, qtype: GGMLQuantizationType
) -> tuple[np.ndarray, GGMLQuantizationType]:
    if role in F32_ROLES or qtype == GGMLQuantizationType.F32:
        return arr.astype(np.float32, copy=False), GGMLQuantizationType.F32
    if qtype == GGMLQuantizationType.F16:
        return arr.astype(np.float16), qtype
    return quantize(arr, qtype), qtype


def _write_gguf(
    spec: SynthSpec,
    dest: Path,
    qtype: GGMLQuantizationType,
    split_max_size: int,
    progress: ProgressSink,
) -> None:
    family = spec.family
    writer = GGUFWriter(dest, family.gguf_arch, split_max_size=split_max_size)
    writer.add_name(f"moepack synthetic {family.name}")
    family.metadata(writer, spec)
    writer.add_file_type(int(_FILE_TYPES[qtype]))
    tokens, scores, types = _vocab(spec.vocab, routing=spec.routing is not None)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_string(SYNTH_SPEC, repr(spec.recorded()))
    if spec.routing is not None:
        writer.add_string(SYNTH_ROUTING, record(routing_plan(spec)))

    plan = _tensor_plan(spec)
    block, type_size = GGML_QUANT_SIZES[qtype]
    total = 0
    for tensor in plan:
        name, shape = tensor.name, tensor.shape
        t = GGMLQuantizationType.F32 if tensor.stored_f32 else qtype
        b, s = GGML_QUANT_SIZES[t]
        nbytes = int(np.prod(shape)) * s // b
        total += nbytes
        dtype = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}.get(
            t, np.uint8
        )
        byte_shape = shape if dtype is not np.uint8 else (*shape[:-1], shape[-1] // b * s)
        writer.add_tensor_info(
            name,
            byte_shape,
            np.dtype(dtype),
            nbytes,
            raw_dtype=None if dtype is not np.uint8 else t,
        )
    del block, type_size
    progress.start(f"writing {dest.name}", total)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in plan:
        values = tensor_values(spec, tensor.name, tensor.shape, tensor.role)
        data, _t = _stored(values, tensor.role, qtype)
        del values
        writer.write_tensor_data(data)
        progress.advance(data.nbytes)
        del data
    writer.close()
    progress.finish()


def synth_model(
    out: str | os.PathLike[str],
    spec: SynthSpec = SynthSpec(),
    split_max_size: int = 0,
    progress: ProgressSink = NULL_PROGRESS,
    companions: Callable[[Path, Path], list[tuple[Path, Path]]] | None = None,
) -> SynthModelResult:
    """Write a synthetic GGUF of ``spec.arch`` to ``out`` (split into shards of at most
    ``split_max_size`` bytes when non-zero; shards are named ``STEM-0000i-of-0000N.gguf``).

    ``companions(staged_model, staging_dir)`` may write files made from the staged model (a
    routing trace) into ``staging_dir`` and return ``(staged, final)`` pairs: they are switched
    into place together with the model (``AtomicOutputs``), so either everything appears or
    nothing does."""
    spec.validate()
    dest = check_destination(check_output_kind(out, GGUF), ())
    if dest.suffix != ".gguf":
        raise BadInput("output name must end in .gguf", dest)
    check_free_space(
        dest.parent,
        spec.estimated_bytes() * (2 if spec.weight_type in LLAMA_FTYPES else 1),
        "the synthetic model",
    )
    try:
        with AtomicOutputs() as outs:  # the shards and companions appear together or not at all
            staging = outs.staged_dir(dest.parent)  # gguf-py and llama.cpp name their files
            if spec.weight_type in LLAMA_FTYPES:
                f32 = staging / "f32.gguf"
                _write_gguf(spec, f32, GGMLQuantizationType.F32, 0, progress)
                staged = staging / dest.name
                llama_quantize(f32, staged, spec.weight_type)
                f32.unlink()
                if split_max_size:
                    raise BadInput(
                        "split output is not available for llama.cpp-quantised synthetic models; split an F32/Q8_0 one"
                    )
                files = [staged]
            else:
                _write_gguf(
                    spec,
                    staging / dest.name,
                    DIRECT_TYPES[spec.weight_type],
                    split_max_size,
                    progress,
                )
                files = sorted(staging.glob(f"{dest.stem}*.gguf"))
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
        tensors=len(_tensor_plan(spec)),
    )


def llama_cpp_available() -> bool:
    """True when llama-cpp-python is importable (K-quants and llama.cpp checks need it)."""
    try:
        import llama_cpp  # noqa: F401
    except Exception:
        return False
    return True


def llama_quantize(src: Path, dst: Path, type_name: str, threads: int = 2) -> None:
    """Quantise ``src`` to ``dst`` with llama.cpp, in a subprocess (llama.cpp aborts on errors)."""
    if type_name not in LLAMA_FTYPES:
        raise BadInput(f"llama.cpp quantisation type must be one of {', '.join(LLAMA_FTYPES)}")
    if not llama_cpp_available():
        raise MoepackError(
            f"{type_name} needs llama.cpp: install llama-cpp-python (pip install 'moepack[llama]')"
        )
    code = (
        "import sys, llama_cpp\n"
        "p = llama_cpp.llama_model_quantize_default_params()\n"
        "p.ftype = int(sys.argv[3]); p.nthread = int(sys.argv[4])\n"
        "rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p)\n"
        "sys.exit(0 if rc == 0 else 3)\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            str(src),
            str(dst),
            str(LLAMA_FTYPES[type_name]),
            str(threads),
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise MoepackError(f"llama.cpp quantisation to {type_name} failed: {tail[0]}", src)
