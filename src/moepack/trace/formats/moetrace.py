"""moepack's native trace, ``.moetrace``: versioned, self-describing, checksummed end to end.

Layout (little-endian)::

    "MOETRACE"            8 bytes
    u32 version           1, or 2 for a trace of several prompts
    u32 header_bytes      H, the length of the JSON header (space-padded so that the body
                          starts on a 64-byte boundary: 20 + H is a multiple of 64)
    u32 header_crc32      CRC-32 of bytes [0, 16) followed by the H header bytes: everything
                          before the body except this field
    JSON header           exactly these keys: format, version, shape [tokens, layers, k],
                          id_dtype, n_expert, prefill_tokens, block_map, model_fingerprint,
                          provenance, weights (null or {dtype, offset}),
                          body {offset, bytes, crc32}; version 2 adds segments,
                          [[start, prefill, decode], ...] one per prompt (prefill_tokens
                          is then their total prefill)
    body                  ids in the smallest unsigned dtype that holds n_expert - 1,
                          token-major; zero padding to 64 bytes; then float32 router weights
                          when present. The file ends where the body ends.

Every byte is covered by a checksum: the header CRC covers the preamble and the JSON header
(padding included), the body CRC (``body.crc32``) the whole body (ids, padding, weights). So any
single-bit flip anywhere is an error, never a trace that silently lost its fingerprint or block
map. On top of the checksum the header is checked strictly: a missing or unknown key, a
duplicate key, a wrong type or an inconsistent offset is an error. Everything a
``RoutingTrace`` holds survives a round trip, so reading and writing again gives the same
bytes. The body is memory-mapped on reading and checked in bounded chunks.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ...errors import BadInput
from ...inputs import load_json
from ..core import PromptSegment, RoutingTrace, check_trace_shape, id_dtype_for
from ._api import FormatModule, ReadOptions, WriteOptions
from ._common import (
    CARRY_BLOCK_MAP,
    CARRY_FINGERPRINT,
    CARRY_PREFILL,
    CARRY_PROVENANCE,
    CARRY_WEIGHTS,
    check_body_length,
    crc32_array,
    file_size,
    jsonable,
    lost_items,
    read_exact_head,
    write_array,
)

NAME = "moetrace"
EXTENSIONS = (".moetrace",)
DESCRIPTION = "moepack native trace: JSON header, checksummed body, carries everything"
VERSIONS = (2, 1)  # newest first; a one-prompt trace is always written as version 1
MAGIC = b"MOETRACE"
_PRE = struct.Struct("<8sIII")  # magic, version, header length, header CRC-32
_CRC_FIELD = 16  # offset of the header CRC: the bytes before it are covered by it
ALIGN = 64
MAX_HEADER = 256 << 20
ID_DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}
_CRC_CHUNK = 64 << 20
HEADER_KEYS = frozenset(
    {
        "format",
        "version",
        "shape",
        "id_dtype",
        "n_expert",
        "prefill_tokens",
        "block_map",
        "model_fingerprint",
        "provenance",
        "weights",
        "body",
    }
)
HEADER_KEYS_V2 = HEADER_KEYS | {"segments"}
BODY_KEYS = frozenset({"offset", "bytes", "crc32"})
WEIGHTS_KEYS = frozenset({"dtype", "offset"})


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def detect(head: bytes) -> bool:
    return head.startswith(MAGIC)


def lost(trace: RoutingTrace, options: WriteOptions) -> list[str]:
    if options.version == 1 and trace.segments is not None:
        return lost_items(trace, _V1_CARRIES)
    return []


_V1_CARRIES = (
    CARRY_WEIGHTS,
    CARRY_PREFILL,
    CARRY_BLOCK_MAP,
    CARRY_FINGERPRINT,
    CARRY_PROVENANCE,
)


def _as_written(trace: RoutingTrace, options: WriteOptions) -> RoutingTrace:
    """Version 1 holds one prefix split: the first prompt's (``lost`` says so)."""
    if options.version == 1 and trace.segments is not None:
        return trace.replace(prefill_tokens=trace.leading_prefill)
    return trace


def _header(trace: RoutingTrace, crc: int) -> bytes:
    dt = id_dtype_for(trace.n_expert)
    ids_bytes = trace.ids.size * dt.itemsize
    weights_bytes = trace.ids.size * 4 if trace.weights is not None else 0

    def encode(body_offset: int) -> bytes:
        w_off = _align(body_offset + ids_bytes)
        body_bytes = (w_off - body_offset + weights_bytes) if weights_bytes else ids_bytes
        header: dict[str, Any] = {
            "format": NAME,
            "version": _version(trace),
            "shape": [trace.tokens, trace.layers, trace.k],
            "id_dtype": dt.name,
            "n_expert": trace.n_expert,
            "prefill_tokens": trace.prefill_tokens,
            "block_map": trace.block_map,
            "model_fingerprint": trace.model_fingerprint,
            "weights": {"dtype": "float32", "offset": w_off} if weights_bytes else None,
            "body": {"offset": body_offset, "bytes": body_bytes, "crc32": f"{crc:08x}"},
            "provenance": jsonable(trace.provenance),
        }
        if trace.segments is not None:
            header["segments"] = [list(seg) for seg in trace.segments]
        return json.dumps(header, sort_keys=True, separators=(",", ":")).encode()

    # The body offset is written inside the header, so find the fixed point (the header
    # only grows with the offset, so this converges in a step or two).
    body_offset = 0
    while True:
        text = encode(body_offset)
        need = _align(_PRE.size + len(text))
        if need <= body_offset:
            break
        body_offset = need
    return text + b" " * (body_offset - _PRE.size - len(text))


def _version(trace: RoutingTrace) -> int:
    """Version 1 for one prompt (the bytes every earlier moepack wrote), 2 with segments."""
    return 2 if trace.segments is not None else 1


def _body_crc(trace: RoutingTrace) -> int:
    dt = id_dtype_for(trace.n_expert)
    crc = crc32_array(trace.ids, dt)
    if trace.weights is not None:
        ids_bytes = trace.ids.size * dt.itemsize
        crc = zlib.crc32(b"\0" * (_align(ids_bytes) - ids_bytes), crc)
        crc = crc32_array(trace.weights, np.dtype(np.float32), crc)
    return crc


def header_crc(fixed: bytes, header: bytes) -> int:
    """CRC-32 of the preamble before the CRC field (magic, version, length) and the header."""
    return zlib.crc32(header, zlib.crc32(fixed))


def write(trace: RoutingTrace, fh: BinaryIO, options: WriteOptions) -> int:
    """Write ``trace``; returns the version the file's field says (1 for one prompt, the
    bytes every earlier moepack wrote, whatever version was asked for)."""
    trace = _as_written(trace, options)
    dt = id_dtype_for(trace.n_expert)
    crc = _body_crc(trace)
    header = _header(trace, crc)
    version = _version(trace)
    fixed = _PRE.pack(MAGIC, version, len(header), 0)[:_CRC_FIELD]
    fh.write(_PRE.pack(MAGIC, version, len(header), header_crc(fixed, header)))
    fh.write(header)
    total = trace.ids.size * dt.itemsize + (trace.ids.size * 4 if trace.has_weights else 0)
    options.progress.start("writing moetrace", total)
    try:
        n = write_array(fh, trace.ids, dt, options.progress)
        if trace.weights is not None:
            fh.write(b"\0" * (_align(n) - n))
            write_array(fh, trace.weights, np.dtype(np.float32), options.progress)
    finally:
        options.progress.finish()
    return version


def _need(header: dict[str, Any], key: str, kind: type | tuple[type, ...], path: Path) -> Any:
    value = header[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise BadInput(f"moetrace header field {key!r} has the wrong type: {value!r}", path)
    return value


def _int(value: Any, what: str, path: Path) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadInput(f"moetrace header field {what} must be a non-negative integer", path)
    return value


def _exact_keys(
    obj: dict[str, Any], keys: frozenset[str], where: str, path: Path, version: int = 1
) -> None:
    """``obj`` has exactly ``keys``: a missing key is not defaulted, an unknown one not
    ignored (either means the header is not one this version wrote)."""
    missing = sorted(keys - obj.keys())
    if missing:
        raise BadInput(f"moetrace {where} lacks {', '.join(map(repr, missing))}", path)
    unknown = sorted(obj.keys() - keys)
    if unknown:
        raise BadInput(
            f"moetrace {where} has unknown key(s) {', '.join(map(repr, unknown))} "
            f"(version {version} defines {', '.join(sorted(keys))})",
            path,
        )


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def read(path: Path, options: ReadOptions) -> RoutingTrace:
    pre = read_exact_head(path, _PRE.size, "moetrace magic, version, header length and CRC")
    magic, version, hlen, crc_stored = _PRE.unpack(pre)
    if magic != MAGIC:
        raise BadInput(f"not a moetrace file: magic is {magic!r}, expected {MAGIC!r}", path)
    if version not in VERSIONS:
        raise BadInput(
            f"unsupported moetrace version {version} (this reads versions 1 and 2)", path
        )
    size = file_size(path)
    if hlen > MAX_HEADER or _PRE.size + hlen > size:
        raise BadInput(
            f"truncated: the header declares {hlen} bytes, the file has {size - _PRE.size} "
            "after the preamble",
            path,
        )
    raw = read_exact_head(path, _PRE.size + hlen, "moetrace header")[_PRE.size :]
    crc_header = header_crc(pre[:_CRC_FIELD], raw)
    if crc_header != crc_stored:
        raise BadInput(
            f"header checksum mismatch: the CRC-32 of the preamble and header is "
            f"{crc_header:08x}, the preamble says {crc_stored:08x} (the file is corrupt)",
            path,
        )
    if (_PRE.size + hlen) % ALIGN:
        raise BadInput(
            f"moetrace header of {hlen} bytes does not end on a {ALIGN}-byte boundary "
            f"(the body must follow it directly)",
            path,
        )
    header = load_json(raw, path, "moetrace header", pairs_hook=_no_duplicates)
    if not isinstance(header, dict):
        raise BadInput("moetrace header is not a JSON object", path)
    _exact_keys(header, HEADER_KEYS_V2 if version == 2 else HEADER_KEYS, "header", path, version)
    if (
        header["format"] != NAME
        or type(header["version"]) is not int
        or header["version"] != version
    ):
        raise BadInput(
            f"moetrace header says format {header['format']!r} version "
            f"{header['version']!r}, the preamble version {version}",
            path,
        )
    shape = _need(header, "shape", list, path)
    if len(shape) != 3:
        raise BadInput(f"moetrace shape must be [tokens, layers, k], got {shape}", path)
    tokens, layers, k = (_int(v, "shape", path) for v in shape)
    check_trace_shape(
        _int(_need(header, "n_expert", int, path), "n_expert", path),
        layers,
        k,
        path,
        "the moetrace header",
    )
    dt_name = _need(header, "id_dtype", str, path)
    if dt_name not in ID_DTYPES:
        raise BadInput(f"moetrace id_dtype {dt_name!r} is not one of {list(ID_DTYPES)}", path)
    dt = np.dtype(ID_DTYPES[dt_name]).newbyteorder("<")
    n_expert = _int(_need(header, "n_expert", int, path), "n_expert", path)
    if n_expert and id_dtype_for(n_expert) != dt:
        raise BadInput(
            f"moetrace id_dtype {dt_name} is not the one for {n_expert} experts "
            f"({id_dtype_for(n_expert).name})",
            path,
        )
    prefill = _int(_need(header, "prefill_tokens", int, path), "prefill_tokens", path)
    block_map = header["block_map"]
    if block_map is not None and (
        not isinstance(block_map, list)
        or not all(isinstance(b, int) and not isinstance(b, bool) for b in block_map)
    ):
        raise BadInput(f"moetrace block_map must be a list of integers: {block_map!r}", path)
    fingerprint = header["model_fingerprint"]
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise BadInput("moetrace model_fingerprint must be a string", path)
    provenance = header["provenance"]
    if not isinstance(provenance, dict):
        raise BadInput("moetrace provenance must be an object", path)
    segments = _segments(header, path) if version == 2 else None
    body = _need(header, "body", dict, path)
    _exact_keys(body, BODY_KEYS, "header field 'body'", path)
    body_offset = _int(body["offset"], "body.offset", path)
    body_bytes = _int(body["bytes"], "body.bytes", path)
    crc_text = body["crc32"]
    if (
        not isinstance(crc_text, str)
        or len(crc_text) != 8
        or any(c not in "0123456789abcdef" for c in crc_text)
    ):
        raise BadInput(f"moetrace body.crc32 {crc_text!r} is not 8 lowercase hex digits", path)
    crc_expected = int(crc_text, 16)
    if body_offset != _PRE.size + hlen:
        raise BadInput(
            f"moetrace body.offset {body_offset} does not follow the header "
            f"(expected {_PRE.size + hlen})",
            path,
        )
    ids_bytes = tokens * layers * k * dt.itemsize
    weights = header["weights"]
    if weights is not None:
        if not isinstance(weights, dict):
            raise BadInput(f"moetrace weights must be null or an object, got {weights!r}", path)
        _exact_keys(weights, WEIGHTS_KEYS, "header field 'weights'", path)
        if weights["dtype"] != "float32":
            raise BadInput(f"moetrace weights must be float32, got {weights['dtype']!r}", path)
        w_off = _int(weights["offset"], "weights.offset", path)
        if w_off != _align(body_offset + ids_bytes):
            raise BadInput(f"moetrace weights.offset {w_off} is not where the ids end", path)
        expected_body = w_off - body_offset + tokens * layers * k * 4
    else:
        w_off = 0
        expected_body = ids_bytes
    if body_bytes != expected_body:
        raise BadInput(
            f"moetrace body.bytes is {body_bytes}, but shape {shape} needs {expected_body}", path
        )
    actual = size - body_offset
    check_body_length(path, actual, expected_body, f"a body of {expected_body} bytes")
    if tokens == 0:
        raise BadInput("the moetrace holds no tokens", path)
    raw_body = np.memmap(path, dtype=np.uint8, mode="r", offset=body_offset, shape=(actual,))
    crc = 0
    for a in range(0, actual, _CRC_CHUNK):
        crc = zlib.crc32(raw_body[a : a + _CRC_CHUNK].data, crc)
    if crc != crc_expected:
        raise BadInput(
            f"checksum mismatch: the body's CRC-32 is {crc:08x}, the header says "
            f"{crc_expected:08x} (the file is corrupt)",
            path,
        )
    if weights is not None and np.any(raw_body[ids_bytes : w_off - body_offset]):
        raise BadInput("moetrace padding between ids and weights is not zero", path)
    del raw_body
    ids = np.memmap(path, dtype=dt, mode="r", offset=body_offset, shape=(tokens, layers, k))
    w = (
        np.memmap(path, dtype="<f4", mode="r", offset=w_off, shape=(tokens, layers, k))
        if weights is not None
        else None
    )
    return RoutingTrace(
        ids=ids,
        n_expert=n_expert,
        weights=w,
        prefill_tokens=prefill,
        segments=segments,
        block_map=block_map,
        model_fingerprint=fingerprint,
        provenance=provenance,
        path=path,
    )


def _segments(header: dict[str, Any], path: Path) -> list[PromptSegment]:
    """The version-2 prompt segments, each three non-negative integers, at least two."""
    raw = _need(header, "segments", list, path)
    if len(raw) < 2 or not all(isinstance(s, list) and len(s) == 3 for s in raw):
        raise BadInput(
            "moetrace segments must be a list of at least two [start, prefill, decode]", path
        )
    return [PromptSegment(*(_int(v, "segments", path) for v in s)) for s in raw]


PLUGIN = FormatModule(__name__)
