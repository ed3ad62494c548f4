"""One GGUF file, opened through gguf-py's memory map and validated before anything trusts it.

gguf-py parses the header lazily from a ``np.memmap``; tensor data is never read to parse the
header. What gguf-py leaves to the caller we check here, so later code can rely on it: every
tensor's bytes lie inside the file, are aligned, and do not overlap; nothing but padding lies
between them. Failures become ``BadInput`` naming the file and the problem.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType

from ..errors import BadInput
from ..inputs import regular_file

SUPPORTED_VERSIONS = (2, 3)
MAX_ARRAY_NESTING = 8
"""Arrays of arrays at most this deep (an array of scalars is 1). llama.cpp's reader refuses
any array of arrays and no converter writes one; gguf-py parses them by recursion, so a
header of 500 nested arrays (12 bytes a level) would end in a ``RecursionError``."""


@dataclass(frozen=True)
class KeyValue:
    """One metadata entry and where its bytes sit in the header."""

    key: str
    value_type: GGUFValueType
    start: int  # offset of the key's length prefix
    end: int  # one past the last byte of the value
    field: Any  # gguf.ReaderField, for typed access
    path: Path

    def array_length(self) -> int | None:
        """How many items an array holds, without decoding them (None for a scalar)."""
        if self.value_type != GGUFValueType.ARRAY:
            return None
        return int(self.field.parts[4][0])  # key length, key, type, item type, count, items

    def value(self) -> Any:
        """The value as Python (str, int, float, bool, or list)."""
        try:
            if self.field.types == [GGUFValueType.ARRAY, GGUFValueType.STRING]:
                return decode_string_array(self.field.parts[self.field.data[0]])
            return self.field.contents()
        except UnicodeDecodeError:
            raise BadInput(
                f"metadata key {self.key!r} holds a string that is not UTF-8", self.path
            ) from None


@dataclass(frozen=True)
class TensorEntry:
    """One tensor: its header entry and its data range in the file."""

    name: str
    ggml_type: GGMLQuantizationType
    ne: tuple[int, ...]  # ggml order, innermost first
    n_bytes: int
    offset: int  # absolute byte offset of the data in the file
    rel_offset: int  # offset relative to the data section, as stored in the header
    info_start: int  # tensor-info entry's byte range in the header
    info_end: int

    @property
    def end(self) -> int:
        return self.offset + self.n_bytes

    @property
    def type_name(self) -> str:
        return self.ggml_type.name

    @property
    def bits_per_weight(self) -> float:
        block, size = GGML_QUANT_SIZES[self.ggml_type]
        return size * 8 / block


def decode_string_array(region: np.ndarray) -> list[str]:
    """The strings of a GGUF string array's bytes (``u64 length, bytes`` repeated)."""
    raw = region.tobytes()
    out, pos = [], 0
    while pos < len(raw):
        n = int.from_bytes(raw[pos : pos + 8], "little")
        out.append(raw[pos + 8 : pos + 8 + n].decode("utf-8"))
        pos += 8 + n
    return out


class _CheckedReader(GGUFReader):
    """gguf-py's reader, made safe and fast for real checkpoints.

    * tensor ranges are checked before views are built;
    * metadata arrays are read as one slice (gguf-py builds one numpy object per element,
      which takes ~14 s for a 150k-token vocabulary); string arrays are scanned with one
      small Python step per string;
    * slices come from a plain ndarray view of the map (``np.memmap`` slicing is slow);
    * arrays of arrays nest at most ``MAX_ARRAY_NESTING`` deep.
    """

    def _get(
        self, offset: int, dtype: Any, count: int = 1, override_order: Any = None
    ) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
        count = int(count)
        dt = np.dtype(dtype)
        end = offset + dt.itemsize * count
        if offset < 0 or end > len(plain):
            raise ValueError(f"header field at byte {offset} runs past the end of the file")
        arr = plain[offset:end].view(dt)[:count]
        return arr.view(
            arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order)
        )

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[Any], list[int], list[Any]]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        n = int(alen[0])
        offs = orig_offs + 12
        itype = GGUFValueType(int(raw_itype[0]))
        types = [GGUFValueType.ARRAY, itype]
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            values = self._get(offs, nptype, n)
            return 12 + int(values.nbytes), [raw_itype, alen, values], [2], types
        if itype == GGUFValueType.STRING:
            plain = self.__dict__["_plain"]
            if n * 8 > len(plain) - offs:
                raise ValueError(
                    f"string array of {n} items at byte {orig_offs} is longer than the file"
                )
            # Only find where the array ends; strings are decoded when asked for
            # (``decode_string_array``), so a 150k-entry vocabulary costs no objects.
            raw = plain.data
            start = offs
            for _ in range(n):
                slen = int.from_bytes(raw[offs : offs + 8], "little")
                offs += 8 + slen
                if offs > len(plain):
                    raise ValueError(
                        f"string array at byte {orig_offs} runs past the end of the file"
                    )
            return offs - orig_offs, [raw_itype, alen, plain[start:offs]], [2], types
        depth = int(self.__dict__.get("_nesting", 0)) + 1
        if depth >= MAX_ARRAY_NESTING:
            raise BadInput(
                f"metadata arrays nest more than {MAX_ARRAY_NESTING} deep (at byte {orig_offs}); "
                "llama.cpp reads no array of arrays"
            )
        self.__dict__["_nesting"] = depth  # gguf-py recurses into this method per element
        try:
            return super()._get_field_parts(orig_offs, raw_type)
        finally:
            self.__dict__["_nesting"] = depth - 1

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        size = len(self.data)
        for field in fields:
            _nlen, name_data, _ndim, dims, raw_dtype, rel = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            try:
                ggml_type = GGMLQuantizationType(int(raw_dtype[0]))
            except ValueError:
                raise BadInput(
                    f"tensor {name!r} has unknown ggml type {int(raw_dtype[0])}"
                ) from None
            if ggml_type not in GGML_QUANT_SIZES:
                raise BadInput(f"tensor {name!r} has unsupported ggml type {ggml_type.name}")
            block, type_size = GGML_QUANT_SIZES[ggml_type]
            n_elems = math.prod(int(d) for d in dims)
            if n_elems == 0:
                raise BadInput(f"tensor {name!r} has a zero dimension {[int(d) for d in dims]}")
            if len(dims) and int(dims[0]) % block:
                raise BadInput(
                    f"tensor {name!r}: row length {int(dims[0])} is not a multiple of the "
                    f"{ggml_type.name} block size {block}"
                )
            n_bytes = n_elems * type_size // block
            begin = start_offs + int(rel[0])
            if int(rel[0]) % self.alignment:
                raise BadInput(
                    f"tensor {name!r} data offset {int(rel[0])} is not aligned to {self.alignment}"
                )
            if begin + n_bytes > size:
                raise BadInput(
                    f"tensor {name!r} data ends at byte {begin + n_bytes:,}, past the end of the "
                    f"file ({size:,} bytes): truncated or corrupt"
                )
        super()._build_tensors(start_offs, fields)


class GgufFile:
    """A validated GGUF file: metadata, tensor entries, header byte ranges."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.size = regular_file(self.path, "GGUF file").st_size
        if self.size < 24:
            raise BadInput(f"too short to be a GGUF file ({self.size} bytes)", self.path)
        with open(self.path, "rb") as fh:
            head = fh.read(8)
        magic = int.from_bytes(head[:4], "little")
        if magic != GGUF_MAGIC:
            raise BadInput(f"not a GGUF file (magic {head[:4]!r}, expected b'GGUF')", self.path)
        version = int.from_bytes(head[4:8], "little")
        if version not in SUPPORTED_VERSIONS:
            raise BadInput(
                f"unsupported GGUF version {version} (supported: "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))})",
                self.path,
            )
        self.version = version
        try:
            self.reader = _CheckedReader(self.path, "r")
        except BadInput as e:
            raise BadInput(e.message, self.path) from None
        except (
            ValueError,
            IndexError,
            KeyError,
            UnicodeDecodeError,
            OverflowError,
            TypeError,
        ) as e:
            raise BadInput(f"corrupt or truncated GGUF header ({e})", self.path) from None
        except MemoryError:
            raise BadInput("corrupt GGUF header (absurd length field)", self.path) from None
        if self.reader.byte_order != "I":
            raise BadInput("big-endian GGUF files are not supported", self.path)
        self.alignment = int(self.reader.alignment)
        self.data_offset = int(self.reader.data_offset)
        self.kv: dict[str, KeyValue] = {}
        for name, field in self.reader.fields.items():
            if field.offset < 24:  # gguf-py's pseudo-fields for the fixed header (version, counts)
                continue
            end = field.offset + sum(int(p.nbytes) for p in field.parts)
            self.kv[name] = KeyValue(name, field.types[0], field.offset, end, field, self.path)
        self.tensors: list[TensorEntry] = []
        for t in self.reader.tensors:
            info_end = t.field.offset + sum(int(p.nbytes) for p in t.field.parts)
            self.tensors.append(
                TensorEntry(
                    name=t.name,
                    ggml_type=t.tensor_type,
                    ne=tuple(int(d) for d in t.shape),
                    n_bytes=int(t.n_bytes),
                    offset=int(t.data_offset),
                    rel_offset=int(t.data_offset) - self.data_offset,
                    info_start=int(t.field.offset),
                    info_end=int(info_end),
                )
            )
        self.header_end = self.tensors[-1].info_end if self.tensors else self._kv_end()
        self._check_layout()
        self.by_name = {t.name: t for t in self.tensors}

    def _kv_end(self) -> int:
        return max((kv.end for kv in self.kv.values()), default=24)

    def _check_layout(self) -> None:
        ordered = sorted(self.tensors, key=lambda t: t.offset)
        for prev, cur in zip(ordered, ordered[1:], strict=False):
            if cur.offset < prev.end:
                raise BadInput(
                    f"tensors {prev.name!r} and {cur.name!r} overlap in the data section", self.path
                )

    @property
    def data_end(self) -> int:
        """One past the last tensor byte (the file may legitimately end with padding)."""
        return max((t.end for t in self.tensors), default=self.data_offset)

    def get(self, key: str, default: Any = None) -> Any:
        kv = self.kv.get(key)
        return kv.value() if kv is not None else default

    def get_int(self, key: str, default: int | None = None, allow_list: bool = False) -> Any:
        """An integer metadata value (or, with ``allow_list``, a list of them), checked."""
        value = self.get(key, default)
        ok = isinstance(value, int) and not isinstance(value, bool)
        if not ok and allow_list and isinstance(value, list):
            ok = all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        if value is not None and not ok:
            raise BadInput(f"metadata key {key!r} must be an integer, got {value!r:.40}", self.path)
        if isinstance(value, int) and value < 0:
            raise BadInput(f"metadata key {key!r} must not be negative, got {value}", self.path)
        return value

    def raw_kv(self, key: str) -> bytes:
        """The exact bytes of one metadata entry (key, type and value)."""
        kv = self.kv[key]
        return bytes(self.reader.data[kv.start : kv.end])

    def header_bytes(self) -> bytes:
        """Magic through the last tensor-info entry (no padding)."""
        return bytes(self.reader.data[: self.header_end])

    def close(self) -> None:
        """Drop the memory map (tensor views from this file become invalid)."""
        mm = getattr(self.reader.data, "_mmap", None)
        self.reader = None  # type: ignore[assignment]
        if mm is not None:
            try:
                mm.close()
            except (BufferError, ValueError):
                pass
