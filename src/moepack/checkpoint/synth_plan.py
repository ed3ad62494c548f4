"""What a synthetic model's file holds, before a byte is written: every tensor's type (one
type for the direct types, llama.cpp's own mix for its K-quant file types, see ``ftypes``),
its bytes and place, the header gguf-py writes, and so the file's exact size.

The header is measured by letting gguf-py serialise it into memory, so the size is what the
writer will write, shards included.
"""

from __future__ import annotations

import io
import os
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
from gguf.constants import GGML_QUANT_SIZES, GGML_QUANT_VERSION
from gguf.gguf_writer import WriterState

from ..keys import SYNTH_ROUTING, SYNTH_SPEC
from .archs import F32_ROLES, TensorPlan
from .ftypes import LLAMA_FTYPES, MixModel, mix_types
from .routing import record, routing_plan, routing_vocab

if TYPE_CHECKING:
    from .synth import SynthSpec

# Types written as they are named: every tensor but the F32 roles in this one type.
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
class PlannedTensor:
    """One tensor as it will be written: its type, size, shard and offset in the shard's data."""

    plan: TensorPlan
    qtype: GGMLQuantizationType
    nbytes: int
    shard: int
    offset: int


@dataclass(frozen=True)
class SynthPlan:
    """The file (or shards) a spec makes: tensors in file order, each shard's header bytes
    (up to where its data starts) and data bytes (alignment padding included)."""

    spec: SynthSpec
    tensors: list[PlannedTensor]
    header_bytes: list[int]
    data_bytes: list[int]

    @property
    def shard_bytes(self) -> list[int]:
        return [h + d for h, d in zip(self.header_bytes, self.data_bytes, strict=True)]

    @property
    def file_bytes(self) -> int:
        return sum(self.shard_bytes)

    @property
    def tensor_bytes(self) -> int:
        """Bytes of tensor data (what the progress bar counts)."""
        return sum(t.nbytes for t in self.tensors)

    def type_counts(self) -> dict[str, int]:
        """How many tensors of each type (the mix at a glance)."""
        return dict(Counter(t.qtype.name for t in self.tensors))

    def to_json(self) -> dict[str, object]:
        return {
            "spec": asdict(self.spec),
            "file_bytes": self.file_bytes,
            "shard_bytes": self.shard_bytes,
            "tensor_bytes": self.tensor_bytes,
            "types": self.type_counts(),
            "tensors": [
                {"name": t.plan.name, "type": t.qtype.name, "bytes": t.nbytes} for t in self.tensors
            ],
        }


def is_mix(weight_type: str) -> bool:
    """A llama.cpp file type whose tensors take llama.cpp's per-tensor type mix."""
    return weight_type in LLAMA_FTYPES


def file_type(weight_type: str) -> int:
    """``general.file_type`` as llama.cpp writes it for this weight type."""
    if is_mix(weight_type):
        return LLAMA_FTYPES[weight_type]
    return int(_FILE_TYPES[DIRECT_TYPES[weight_type]])


def mix_model(spec: SynthSpec) -> MixModel:
    """What llama.cpp's type rules read of this model (its hyper-parameters as written)."""
    family = spec.family
    kv = family.head_count_kv(spec)
    return MixModel(
        n_layer=spec.layers,
        n_expert=spec.experts,
        n_gqa=spec.heads // kv if kv else 0,
        llama_70b=family.llama_70b(spec),
    )


def tensor_types(spec: SynthSpec) -> list[tuple[TensorPlan, GGMLQuantizationType]]:
    """Every tensor in file order with the type it is written in."""
    plan = spec.family.tensors(spec)
    if is_mix(spec.weight_type):
        mix = mix_types(spec.weight_type, mix_model(spec), [(t.name, t.shape) for t in plan])
        return [(t, mix[t.name]) for t in plan]
    qtype = DIRECT_TYPES[spec.weight_type]
    return [(t, GGMLQuantizationType.F32 if t.role in F32_ROLES else qtype) for t in plan]


def tensor_nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape, dtype=np.int64)) // block * size


def vocab(n: int, routing: bool = False) -> tuple[list[bytes], list[float], list[int]]:
    """An SPM ("llama") vocabulary: <unk> <s> </s>, 256 byte tokens, then word pieces (for
    routing models, pieces that prompt text round-trips through)."""
    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    if routing:
        words = routing_vocab(n)
        scores = [0.0] * 259 + [-float(j) for j in range(len(words))]
        return (
            tokens + words,
            scores,
            [int(t) for t in types] + [int(TokenType.NORMAL)] * len(words),
        )
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    while len(tokens) < n:
        a, b = divmod(i, len(letters))
        piece = (
            ("\u2581" if i % 2 == 0 else "")
            + letters[b]
            + (letters[a % 26] * (a // 26 + 1) if a else "")
        )
        tokens.append(piece.encode("utf-8"))
        types.append(TokenType.NORMAL)
        i += 1
    scores = [0.0] * 3 + [0.0] * 256 + [-float(j) for j in range(n - 259)]
    return tokens, scores, [int(t) for t in types]


def gguf_writer(
    spec: SynthSpec,
    path: str | os.PathLike[str] | None,
    typed: list[tuple[TensorPlan, GGMLQuantizationType]],
    split_max_size: int = 0,
) -> GGUFWriter:
    """A gguf-py writer holding the model's metadata and tensor index (no file opened yet)."""
    family = spec.family
    writer = GGUFWriter(path, family.gguf_arch, split_max_size=split_max_size)
    writer.add_name(f"moepack synthetic {family.name}")
    family.metadata(writer, spec)
    writer.add_file_type(file_type(spec.weight_type))
    if is_mix(spec.weight_type):  # llama.cpp's quantiser adds it
        writer.add_quantization_version(GGML_QUANT_VERSION)
    tokens, scores, types = vocab(spec.vocab, routing=spec.routing is not None)
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
    for tensor, qtype in typed:
        shape = tensor.shape
        nbytes = tensor_nbytes(shape, qtype)
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor_info(tensor.name, shape, np.dtype(np.float32), nbytes)
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor_info(tensor.name, shape, np.dtype(np.float16), nbytes)
        else:
            block, size = GGML_QUANT_SIZES[qtype]
            byte_shape = (*shape[:-1], shape[-1] // block * size)
            writer.add_tensor_info(
                tensor.name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype
            )
    return writer


def lay_out(
    writer: GGUFWriter, typed: list[tuple[TensorPlan, GGMLQuantizationType]]
) -> tuple[list[PlannedTensor], list[int]]:
    """Each tensor's shard and offset in it, as the writer placed them; each shard's data bytes."""
    where = {name: i for i, shard in enumerate(writer.tensors) for name in shard}
    ends = [0] * len(writer.tensors)
    out = []
    for tensor, qtype in typed:
        shard = where[tensor.name]
        nbytes = tensor_nbytes(tensor.shape, qtype)
        out.append(PlannedTensor(tensor, qtype, nbytes, shard, ends[shard]))
        ends[shard] += GGUFWriter.ggml_pad(nbytes, writer.data_alignment)
    return out, ends


def header_bytes(writer: GGUFWriter) -> list[int]:
    """Each shard's header, KV data and tensor index as gguf-py serialises them, padded to
    where its data starts. Consumes ``writer`` (it is serialised into memory)."""
    buffers = [io.BytesIO() for _ in writer.tensors]
    writer.fout = cast("list[io.BufferedWriter]", buffers)
    writer.state = WriterState.EMPTY
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    return [GGUFWriter.ggml_pad(b.tell(), writer.data_alignment) for b in buffers]


def plan_synth(spec: SynthSpec, split_max_size: int = 0) -> SynthPlan:
    """The file ``spec`` makes, to the byte, without writing it (``spec`` is validated)."""
    spec.validate()
    typed = tensor_types(spec)
    writer = gguf_writer(spec, Path("plan.gguf"), typed, split_max_size)
    tensors, data = lay_out(writer, typed)
    return SynthPlan(spec, tensors, header_bytes(writer), data)
