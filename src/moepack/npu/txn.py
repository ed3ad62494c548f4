"""Decode NPU2 instruction streams ("TXN"): operations, buffer descriptors, patch records.

Layout (reference §7, field positions as in aie-rt's transaction structs): a 4-word header
``{u8 major, minor, dev_gen, rows; u8 cols, mem_tile_rows; u16; u32 num_ops; u32 size}``,
NPU2 word 0 = 0x06040100; then operations, one 32-bit word at a time, opcode in the low byte
of word 0:

==========  ====  =====  ==========================================================
WRITE       0x00  6      reg offset (u64) at word 2, value at 4
BLOCKWRITE  0x01  4 + n  reg offset at word 2, byte size at 3; a buffer descriptor is
                         8 data words: buffer_length (32-bit words) at op word 4,
                         buffer_offset at op word 5
MASKWRITE   0x03  7      reg offset at word 2, value at 4, mask at 5
TCT sync    0x80  4      custom op: byte size at word 1
DDR_PATCH   0x81  12     custom op: reg addr (u64) at word 6, arg_idx at word 8,
                         arg_offset at word 10
==========  ====  =====  ==========================================================

A patch makes a buffer descriptor read a kernel argument's buffer at ``arg_offset`` (an
offset *into that buffer*, not a device address). Pairing each patch with the descriptor it
patches gives the read regions per argument, summarised as runs of (offset, length, stride).
An unknown opcode is reported with its byte offset; custom ops (>= 0x80) carry their size,
so decoding skips them and goes on, any other unknown opcode stops the stream there.
"""

from __future__ import annotations

import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BadInput
from . import elf

NPU2_W0 = 0x06040100
HEADER_WORDS = 4
OPS = {0x00: ("WRITE", 6), 0x01: ("BLOCKWRITE", None), 0x03: ("MASKWRITE", 7), 0x80: ("TCT", 4),
       0x81: ("DDR_PATCH", 12)}  # fmt: skip
BD_WORDS = 8


@dataclass
class Op:
    index: int
    offset: int  # byte offset in the stream
    opcode: int
    name: str
    words: int
    fields: dict[str, int] = field(default_factory=dict)


@dataclass
class BufferDescriptor:
    op_index: int
    offset: int
    reg: int
    length_words: int
    buffer_offset: int
    words: list[int]

    @property
    def length_bytes(self) -> int:
        return 4 * self.length_words


@dataclass
class Patch:
    op_index: int
    offset: int
    reg: int
    arg_idx: int
    arg_offset: int
    bd: BufferDescriptor | None

    @property
    def region(self) -> tuple[int, int] | None:
        if self.bd is None:
            return None
        return self.arg_offset + self.bd.buffer_offset, self.bd.length_bytes


@dataclass
class Run:
    """``count`` regions of ``length`` bytes starting at ``offset``, ``stride`` apart."""

    offset: int
    length: int
    count: int
    stride: int

    @property
    def end(self) -> int:
        return self.offset + (self.count - 1) * self.stride + self.length


@dataclass
class ArgSummary:
    arg_idx: int
    patches: int
    bytes: int
    lo: int
    hi: int
    runs: list[Run]


@dataclass
class Problem:
    offset: int
    message: str


@dataclass
class Stream:
    """One TXN (a file or a ``.ctrltext`` section can hold several)."""

    offset: int
    header: dict[str, int]
    ops: list[Op]
    bds: list[BufferDescriptor]
    patches: list[Patch]
    problems: list[Problem]
    words: int
    complete: bool

    def op_counts(self) -> dict[str, int]:
        return dict(Counter(op.name for op in self.ops))

    def regions(self) -> list[ArgSummary]:
        return summarise(self.patches)


@dataclass
class TxnResult:
    path: str
    container: str  # "raw" | "elf:.ctrltext"
    streams: list[Stream]

    @property
    def problems(self) -> list[Problem]:
        return [p for s in self.streams for p in s.problems]


def _w(buf: bytes, byte_off: int) -> int:
    return struct.unpack_from("<I", buf, byte_off)[0]


def _q(buf: bytes, byte_off: int) -> int:
    return struct.unpack_from("<Q", buf, byte_off)[0]


def decode_stream(buf: bytes, base: int = 0) -> Stream:
    """Decode one TXN starting at byte ``base`` of ``buf``."""
    problems: list[Problem] = []
    if len(buf) - base < 16:
        raise BadInput(f"stream at byte {base:#x} is shorter than the 16-byte TXN header")
    w0, w1, num_ops, size = struct.unpack_from("<IIII", buf, base)
    header = {
        "major": w0 & 0xFF, "minor": (w0 >> 8) & 0xFF, "dev_gen": (w0 >> 16) & 0xFF,
        "rows": w0 >> 24, "cols": w1 & 0xFF, "mem_tile_rows": (w1 >> 8) & 0xFF,
        "num_ops": num_ops, "size": size, "w0": w0,
    }  # fmt: skip
    if w0 != NPU2_W0:
        problems.append(Problem(base, f"header word 0 is {w0:#010x}, not NPU2's {NPU2_W0:#010x}"))
    end = base + size
    if size < 16 or size % 4:
        problems.append(Problem(base, f"header size {size} is not a whole number of words"))
        end = len(buf)
    elif end > len(buf):
        problems.append(
            Problem(base, f"header says {size:,} bytes, only {len(buf) - base:,} remain")
        )
        end = len(buf)
    ops: list[Op] = []
    bds: list[BufferDescriptor] = []
    patches: list[Patch] = []
    at = base + 16
    complete = True
    while at < end:
        if end - at < 4:
            problems.append(Problem(at, f"{end - at} stray bytes at the end of the stream"))
            break
        w = _w(buf, at)
        opcode = w & 0xFF
        known = OPS.get(opcode)
        if known is None:
            size_field = _w(buf, at + 4) if end - at >= 8 else 0
            if (
                opcode >= 0x80
                and size_field >= 8
                and size_field % 4 == 0
                and at + size_field <= end
            ):
                problems.append(Problem(at, f"unknown opcode {opcode:#04x} at byte {at:#x} "
                                            f"(word {(at - base) // 4}); skipped {size_field // 4} "
                                            "words using its size field"))  # fmt: skip
                ops.append(
                    Op(len(ops), at - base, opcode, f"UNKNOWN_{opcode:#04x}", size_field // 4)
                )
                at += size_field
                continue
            problems.append(Problem(at, f"unknown opcode {opcode:#04x} at byte {at:#x} "
                                        f"(word {(at - base) // 4}); its length is unknown, "
                                        f"{(end - at) // 4:,} words left undecoded"))  # fmt: skip
            complete = False
            break
        name, words = known
        if name == "BLOCKWRITE":
            if end - at < 16:
                problems.append(Problem(at, "BLOCKWRITE header is truncated"))
                complete = False
                break
            nbytes = _w(buf, at + 12)
            if nbytes < 16 or nbytes % 4 or at + nbytes > end:
                problems.append(
                    Problem(at, f"BLOCKWRITE at byte {at:#x} has impossible size {nbytes}")
                )
                complete = False
                break
            words = nbytes // 4
        if at + 4 * words > end:
            problems.append(Problem(at, f"{name} at byte {at:#x} is truncated ({words} words)"))
            complete = False
            break
        op = Op(len(ops), at - base, opcode, name, words)
        if name in ("WRITE", "MASKWRITE"):
            op.fields = {"reg": _q(buf, at + 8), "value": _w(buf, at + 16)}
            if name == "MASKWRITE":
                op.fields["mask"] = _w(buf, at + 20)
        elif name == "BLOCKWRITE":
            reg = _w(buf, at + 8)
            op.fields = {"reg": reg, "data_words": words - 4}
            if words - 4 == BD_WORDS:
                data = list(struct.unpack_from("<8I", buf, at + 16))
                bds.append(BufferDescriptor(op.index, at - base, reg, data[0], data[1], data))
        elif name == "TCT":
            op.fields = {"word": _w(buf, at + 8), "config": _w(buf, at + 12)}
        elif name == "DDR_PATCH":
            reg, arg, plus = _q(buf, at + 24), _q(buf, at + 32), _q(buf, at + 40)
            op.fields = {"reg": reg, "arg_idx": arg, "arg_offset": plus}
            patches.append(Patch(op.index, at - base, reg, arg, plus, _bd_for(bds, reg)))
        ops.append(op)
        at += 4 * words
    if complete and num_ops != len(ops):
        problems.append(Problem(base, f"header counts {num_ops} operations, decoded {len(ops)}"))
    return Stream(
        base, header, ops, bds, patches, problems, (min(end, len(buf)) - base) // 4, complete
    )


def _bd_for(bds: list[BufferDescriptor], reg: int) -> BufferDescriptor | None:
    """The descriptor a patch targets: the latest one whose 8 registers hold ``reg`` (the
    address word), else the latest one written."""
    for bd in reversed(bds):
        if bd.reg <= (reg & 0xFFFFFFFF) < bd.reg + 4 * BD_WORDS:
            return bd
    return bds[-1] if bds else None


def summarise(patches: list[Patch]) -> list[ArgSummary]:
    """Per kernel argument: regions in stream order folded into equal-length, equal-stride runs."""
    by_arg: dict[int, list[tuple[int, int]]] = {}
    for p in patches:
        r = p.region
        if r is not None:
            by_arg.setdefault(p.arg_idx, []).append(r)
    out = []
    for arg, regions in sorted(by_arg.items()):
        runs: list[Run] = []
        for off, length in regions:
            last = runs[-1] if runs else None
            if last and last.length == length:
                if last.count == 1 and off != last.offset:
                    last.stride, last.count = off - last.offset, 2
                    continue
                if (
                    last.count > 1
                    and off - (last.offset + (last.count - 1) * last.stride) == last.stride
                ):
                    last.count += 1
                    continue
            runs.append(Run(off, length, 1, 0))
        out.append(ArgSummary(arg, len(regions), sum(n for _, n in regions),
                              min(o for o, _ in regions), max(o + n for o, n in regions), runs))  # fmt: skip
    return out


def decode_bytes(data: bytes) -> list[Stream]:
    """All TXNs in ``data``, back to back (a ``.ctrltext`` may hold several)."""
    streams = []
    at = 0
    while at + 16 <= len(data):
        s = decode_stream(data, at)
        streams.append(s)
        size = s.header["size"]
        if not s.complete or size < 16 or size % 4 or at + size > len(data):
            break
        at += size
        if at + 16 <= len(data) and _w(data, at) != NPU2_W0:
            if any(data[at:]):
                s.problems.append(
                    Problem(at, f"{len(data) - at:,} bytes after the stream are not a TXN")
                )
            break
    if not streams:
        raise BadInput(f"{len(data)} bytes: too short for a TXN header")
    return streams


def decode_file(path: str | os.PathLike[str]) -> TxnResult:
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise BadInput(e.strerror or str(e), path) from None
    container = "raw"
    if elf.is_elf(data):
        data = elf.section_bytes(data, ".ctrltext", str(path))
        container = "elf:.ctrltext"
    try:
        streams = decode_bytes(data)
    except BadInput as e:
        raise BadInput(e.message, path) from None
    return TxnResult(str(path), container, streams)


# -- building streams (tests, fixtures, documentation) ---------------------------------


def op_write(reg: int, value: int) -> bytes:
    return struct.pack("<IIQII", 0x00, 0, reg, value, 24)


def op_maskwrite(reg: int, value: int, mask: int) -> bytes:
    return struct.pack("<IIQIII", 0x03, 0, reg, value, mask, 28)


def op_blockwrite(reg: int, data: list[int]) -> bytes:
    return struct.pack("<IIII", 0x01, 0, reg, 16 + 4 * len(data)) + struct.pack(
        f"<{len(data)}I", *data
    )


def op_bd(reg: int, length_words: int, buffer_offset: int = 0) -> bytes:
    return op_blockwrite(reg, [length_words, buffer_offset, 0, 0, 0, 0, 0, 0])


def op_tct(word: int = 0, config: int = 0) -> bytes:
    return struct.pack("<IIII", 0x80, 16, word, config)


def op_patch(reg: int, arg_idx: int, arg_offset: int) -> bytes:
    return struct.pack("<IIIIIIQQQ", 0x81, 48, 0, 40, 0, 0, reg, arg_idx, arg_offset)


def build_stream(
    ops: list[bytes], w0: int = NPU2_W0, cols: int = 4, num_ops: int | None = None
) -> bytes:
    body = b"".join(ops)
    n = len(ops) if num_ops is None else num_ops
    return struct.pack("<IIII", w0, cols | (1 << 8), n, 16 + len(body)) + body
