"""Decode NPU2 instruction streams ("TXN"): operations, buffer descriptors, patch records.

Layout (reference §7, field positions as in aie-rt's transaction structs, checked against
mlir-aie's own ``aie-translate --aie-npu-to-binary`` test vectors, tests/npu/data): a 4-word
header ``{u8 major, minor, dev_gen, rows; u8 cols, mem_tile_rows; u16; u32 num_ops; u32
size}``, word 0 = 0x06040100 on NPU2 (dev_gen 4) and 0x06030100 on NPU1 (dev_gen 3); then
operations, opcode in the low byte of word 0:

==========  ====  ======  =========  =====================================================
op          code  ref §7  Size at    fields decoded
==========  ====  ======  =========  =====================================================
WRITE       0x00  6       byte 20    reg offset (u64) at word 2, value at 4
BLOCKWRITE  0x01  12      byte 12    reg offset at word 2; a buffer descriptor is 8 data
                                     words: buffer_length (32-bit words) at op word 4,
                                     buffer_offset at op word 5
MASKWRITE   0x03  7       byte 24    reg offset at word 2, value at 4, mask at 5
PREEMPT     0x06  -       (1 word)   level in byte 1 of word 0
LOAD_PDI    0x08  -       (4 words)  id in the high half of word 0, size at 1, address
                                     (u64) at 2
TCT sync    0x80  4       byte 4     custom op: word 2 = direction | row << 8 | column <<
                                     16, word 3 = row_num << 8 | column_num << 16 |
                                     channel << 24
DDR_PATCH   0x81  12      byte 4     custom op: reg addr (u64) at word 6, arg_idx (u64) at
                                     word 8, arg_offset (u64) at words 10-11
READ_REGS   0x82  -       byte 4     custom op: count at word 2, register addresses after
==========  ====  ======  =========  =====================================================

A register address is ``column << 25 | row << 20 | tile-local address (20 bits)`` on both
devices (mlir-aie's ``getColumnShift``/``getRowShift`` for AIE2 and AIE2P); the decoder
gives all three.

Every op carries its own byte size (aie-rt's ``Size`` fields, column "Size at"); the decoder
advances by it, so an op longer than the reference says (aie-rt's ``XAie_MaskWrite32Hdr`` is
32 bytes = 8 words, the reference says 7) cannot make it lose sync. A Size that disagrees
with the reference's word count is reported as a warning with its offset; a Size of 0 (a
stream assembled from the reference alone) falls back on the reference's count, also noted;
an impossible Size (too small for the op's fields, not whole words, past the stream) stops
the stream with an error. Bytes that do not start with a TXN header (word 0 not NPU2's, or
more operations declared than the declared size can hold) are refused before any decoding.

A patch makes a buffer descriptor read a kernel argument's buffer at ``arg_offset`` (an
offset *into that buffer*, not a device address): the runtime *writes* the buffer's address
plus ``arg_offset`` into the patched register (the descriptor's base-address word), so the
descriptor's own value of that word is replaced, not added (mlir-aie's lowering puts the
whole offset in ``arg_plus`` and 0 in the descriptor word). A descriptor whose patched word
is nonzero is reported. An ``arg_idx`` outside the kernel's five buffer objects is reported
and kept out of the read regions. Each patch is paired with the latest
descriptor whose 8 registers hold the patched register; a patch no descriptor covers is
reported (warning) and left unpaired, never guessed. Paired patches give the read regions
per argument, summarised as runs of (offset, length, stride). An unknown opcode is reported
with its byte offset; custom ops (>= 0x80) carry their size, so decoding skips them and goes
on, any other unknown opcode stops the stream there.

Reference §7 also gives the sizes of the runtime's streams and ELFs (``REFERENCE``); a
decoded stream or ELF of one of those sizes is checked against the others (word count,
patch records, ELF bytes) and the result is part of the summary.
"""

from __future__ import annotations

import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BadInput
from ..inputs import read_capped
from . import elf

NPU2_W0 = 0x06040100
NPU1_W0 = 0x06030100
DEVICES = {NPU1_W0: "npu1", NPU2_W0: "npu2"}  # header word 0 -> device (mlir-aie vectors)
HEADER_WORDS = 4
BD_WORDS = 8
BUFFER_OBJECTS = 5  # the seed's kernel ABI: arguments 0..4 are buffer objects
COL_SHIFT, ROW_SHIFT, LOCAL_MASK = 25, 20, 0xFFFFF  # AIE2 / AIE2P register addresses


def tile_address(reg: int) -> dict[str, int]:
    """Column, row and tile-local address of a register address (``col << 25 | row << 20 |
    local``), as mlir-aie composes it for write32/maskwrite32/blockwrite."""
    reg &= 0xFFFFFFFF
    return {"column": reg >> COL_SHIFT, "row": (reg >> ROW_SHIFT) & 0x1F, "local": reg & LOCAL_MASK}


@dataclass(frozen=True)
class OpFormat:
    name: str
    ref_words: int  # the reference's word count (§7)
    size_at: int | None  # byte offset of the op's own Size field (aie-rt); None: fixed
    min_bytes: int  # the smallest size that holds the fields decoded here (fixed: its size)


OPS = {
    0x00: OpFormat("WRITE", 6, 20, 24),  # XAie_Write32Hdr
    0x01: OpFormat("BLOCKWRITE", 12, 12, 16),  # XAie_BlockWrite32Hdr + data (12 = a BD)
    0x03: OpFormat("MASKWRITE", 7, 24, 28),  # XAie_MaskWrite32Hdr (sizeof is 32 in aie-rt)
    0x06: OpFormat("PREEMPT", 1, None, 4),  # one word, no Size field (mlir-aie vectors)
    0x08: OpFormat("LOAD_PDI", 4, None, 16),  # four words, no Size field (mlir-aie vectors)
    0x80: OpFormat("TCT", 4, 4, 16),  # XAie_CustomOpHdr + tct_op_t
    0x81: OpFormat("DDR_PATCH", 12, 4, 48),  # XAie_CustomOpHdr + patch_op_t
    0x82: OpFormat("READ_REGS", 4, 4, 12),  # custom op: count, then that many addresses
}


@dataclass(frozen=True)
class ReferenceStream:
    """Sizes reference §7 gives for one kind of layer stream and its ELF."""

    what: str
    words: int
    elf_bytes: int
    patches: int | None


REFERENCE = (
    ReferenceStream("linear layer", 24_636, 103_104, 630),
    ReferenceStream("full-attention layer", 20_566, 86_208, 530),
    ReferenceStream("lm_head", 260, 1_680, None),
)


@dataclass
class Op:
    index: int
    offset: int  # byte offset in the stream
    opcode: int
    name: str
    words: int
    fields: dict[str, int] = field(default_factory=dict)
    payload: list[int] = field(default_factory=list)  # BLOCKWRITE data, READ_REGS addresses


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
    def arg_known(self) -> bool:
        """Whether ``arg_idx`` names one of the kernel's buffer objects."""
        return 0 <= self.arg_idx < BUFFER_OBJECTS

    @property
    def region(self) -> tuple[int, int] | None:
        """(offset into the argument's buffer, bytes): the patch replaces the descriptor's
        base-address word, so the region starts at ``arg_offset`` alone."""
        if self.bd is None or not self.arg_known:
            return None
        return self.arg_offset, self.bd.length_bytes


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
    offset: int  # byte offset of the (first) op concerned
    message: str
    count: int = 1  # ops of the same kind this one stands for (warnings are grouped)

    def text(self) -> str:
        more = f" ({self.count - 1:,} more like it)" if self.count > 1 else ""
        return self.message + more


@dataclass
class RefCheck:
    """One reference §7 number against what was decoded."""

    reference: str  # "linear layer"
    identified_by: str  # "stream words" | "ELF size"
    quantity: str  # "words" | "patch records" | "ELF bytes"
    expected: int
    got: int

    @property
    def ok(self) -> bool:
        return self.expected == self.got


@dataclass
class Stream:
    """One TXN (a file or a ``.ctrltext`` section can hold several)."""

    offset: int
    device: str  # "npu1" | "npu2", from header word 0
    header: dict[str, int]
    ops: list[Op]
    bds: list[BufferDescriptor]
    patches: list[Patch]
    problems: list[Problem]  # errors: the stream could not be decoded as it claims
    words: int
    complete: bool
    warnings: list[Problem] = field(default_factory=list)  # decoded, but note these

    @property
    def unpaired(self) -> int:
        return sum(p.bd is None for p in self.patches)

    def op_counts(self) -> dict[str, int]:
        return dict(Counter(op.name for op in self.ops))

    def regions(self) -> list[ArgSummary]:
        return summarise(self.patches)


@dataclass
class TxnResult:
    path: str
    container: str  # "raw" | "elf:.ctrltext"
    streams: list[Stream]
    file_bytes: int = 0
    reference: list[RefCheck] = field(default_factory=list)

    @property
    def problems(self) -> list[Problem]:
        return [p for s in self.streams for p in s.problems]

    @property
    def warnings(self) -> list[Problem]:
        return [p for s in self.streams for p in s.warnings]


def _w(buf: bytes, byte_off: int) -> int:
    return struct.unpack_from("<I", buf, byte_off)[0]


def _q(buf: bytes, byte_off: int) -> int:
    return struct.unpack_from("<Q", buf, byte_off)[0]


class _Warnings:
    """Warnings grouped by kind: the first one's offset and message, and a count."""

    def __init__(self) -> None:
        self.by_key: dict[tuple, Problem] = {}

    def add(self, key: tuple, offset: int, message: str) -> None:
        if key in self.by_key:
            self.by_key[key].count += 1
        else:
            self.by_key[key] = Problem(offset, message)

    def list(self) -> list[Problem]:
        return sorted(self.by_key.values(), key=lambda p: p.offset)


MIN_OP_BYTES = 8  # the smallest op the decoder can step over: an unknown custom op


def not_a_txn(buf: bytes, base: int = 0) -> str | None:
    """Why the 16 bytes at ``base`` are not a TXN header, or ``None`` if they are one.

    Checked before decoding, so that random bytes are refused rather than "decoded": word 0
    must be NPU2's or NPU1's, and the declared operations must fit in the declared size (or, when that
    size is itself impossible, in the bytes there are), at 8 bytes for the smallest op."""
    if len(buf) - base < 16:
        return f"stream at byte {base:#x} is shorter than the 16-byte TXN header"
    w0, _w1, num_ops, size = struct.unpack_from("<IIII", buf, base)
    where = f"at byte {base:#x}: " if base else ""
    if w0 not in DEVICES:
        return (
            f"not a TXN stream: {where}header word 0 is {w0:#010x}, not NPU2's "
            f"{NPU2_W0:#010x} or NPU1's {NPU1_W0:#010x}"
        )
    room = size if size >= 16 and size % 4 == 0 else len(buf) - base
    fit = max(0, room - 16) // MIN_OP_BYTES
    if num_ops > fit:
        return (
            f"not a TXN stream: {where}header declares {num_ops:,} operations in {room:,} "
            f"bytes (at most {fit:,} fit)"
        )
    return None


def decode_stream(buf: bytes, base: int = 0) -> Stream:
    """Decode one TXN starting at byte ``base`` of ``buf``; ``BadInput`` if there is no TXN
    header there (see ``not_a_txn``)."""
    problems: list[Problem] = []
    warn = _Warnings()
    why = not_a_txn(buf, base)
    if why:
        raise BadInput(why)
    w0, w1, num_ops, size = struct.unpack_from("<IIII", buf, base)
    header = {
        "major": w0 & 0xFF,
        "minor": (w0 >> 8) & 0xFF,
        "dev_gen": (w0 >> 16) & 0xFF,
        "rows": w0 >> 24,
        "cols": w1 & 0xFF,
        "mem_tile_rows": (w1 >> 8) & 0xFF,
        "num_ops": num_ops,
        "size": size,
        "w0": w0,
    }
    device = DEVICES[w0]
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
        word = (at - base) // 4
        if end - at < 4:
            problems.append(Problem(at, f"{end - at} stray bytes at the end of the stream"))
            break
        opcode = _w(buf, at) & 0xFF
        fmt = OPS.get(opcode)
        if fmt is None:
            size_field = _w(buf, at + 4) if end - at >= 8 else 0
            if (
                opcode >= 0x80
                and size_field >= 8
                and size_field % 4 == 0
                and at + size_field <= end
            ):
                problems.append(
                    Problem(
                        at,
                        f"unknown opcode {opcode:#04x} at byte {at:#x} "
                        f"(word {word}); skipped {size_field // 4} "
                        "words using its size field",
                    )
                )
                ops.append(
                    Op(len(ops), at - base, opcode, f"UNKNOWN_{opcode:#04x}", size_field // 4)
                )
                at += size_field
                continue
            problems.append(
                Problem(
                    at,
                    f"unknown opcode {opcode:#04x} at byte {at:#x} "
                    f"(word {word}); its length is unknown, "
                    f"{(end - at) // 4:,} words left undecoded",
                )
            )
            complete = False
            break
        name = fmt.name
        where = f"{name} at byte {at:#x} (word {word})"
        if end - at < (fmt.min_bytes if fmt.size_at is None else fmt.size_at + 4):
            problems.append(Problem(at, f"{where} is truncated"))
            complete = False
            break
        nbytes = fmt.min_bytes if fmt.size_at is None else _w(buf, at + fmt.size_at)
        if fmt.size_at is None:
            words = nbytes // 4
        elif nbytes == 0:  # no Size field (a stream built from the reference's word counts)
            words = fmt.ref_words
            warn.add(
                ("nosize", name),
                at,
                f"{where} has no Size field (0); assumed the reference's {words} words",
            )
            if at + 4 * words > end:
                problems.append(Problem(at, f"{where} is truncated ({words} words)"))
                complete = False
                break
        elif nbytes % 4 or nbytes < fmt.min_bytes or at + nbytes > end:
            why = "past the end of the stream" if at + nbytes > end else "impossible"
            problems.append(
                Problem(
                    at,
                    f"{where} has Size {nbytes:,} ({why}; at least "
                    f"{fmt.min_bytes} bytes, whole words)",
                )
            )
            complete = False
            break
        else:
            words = nbytes // 4
            if name not in ("BLOCKWRITE", "READ_REGS") and words != fmt.ref_words:
                warn.add(
                    ("size", name, words),
                    at,
                    f"{where}: its Size field says {nbytes} B "
                    f"({words} words), the reference says {fmt.ref_words} words; "
                    "followed the Size field",
                )
        op = Op(len(ops), at - base, opcode, name, words)
        if name in ("WRITE", "MASKWRITE"):
            reg = _q(buf, at + 8)
            op.fields = {"reg": reg, **tile_address(reg), "value": _w(buf, at + 16)}
            if name == "MASKWRITE":
                op.fields["mask"] = _w(buf, at + 20)
        elif name == "BLOCKWRITE":
            reg, tile_word = _w(buf, at + 8), _w(buf, at + 4)
            op.fields = {"reg": reg, **tile_address(reg), "data_words": words - 4}
            if tile_word:  # mlir-aie sets word 1 = column | row << 8 when the op names a tile
                op.fields["tile_column"], op.fields["tile_row"] = tile_word & 0xFF, tile_word >> 8
            op.payload = list(struct.unpack_from(f"<{words - 4}I", buf, at + 16))
            if words - 4 == BD_WORDS:
                data = op.payload
                bds.append(BufferDescriptor(op.index, at - base, reg, data[0], data[1], data))
        elif name == "PREEMPT":
            op.fields = {"level": (_w(buf, at) >> 8) & 0xFF}
        elif name == "LOAD_PDI":
            op.fields = {
                "id": _w(buf, at) >> 16,
                "size": _w(buf, at + 4),
                "address": _q(buf, at + 8),
            }
        elif name == "TCT":
            w2, w3 = _w(buf, at + 8), _w(buf, at + 12)
            op.fields = {
                "word": w2,
                "config": w3,
                "direction": w2 & 0xFF,
                "row": (w2 >> 8) & 0xFF,
                "column": (w2 >> 16) & 0xFF,
                "row_num": (w3 >> 8) & 0xFF,
                "column_num": (w3 >> 16) & 0xFF,
                "channel": w3 >> 24,
            }
        elif name == "READ_REGS":
            count = _w(buf, at + 8)
            if 3 + count != words:
                problems.append(Problem(at, f"{where} counts {count:,} registers in {words} words"))
                complete = False
                break
            op.fields = {"count": count}
            op.payload = list(struct.unpack_from(f"<{count}I", buf, at + 12))
        elif name == "DDR_PATCH":
            reg, arg, plus = _q(buf, at + 24), _q(buf, at + 32), _q(buf, at + 40)
            op.fields = {"reg": reg, "arg_idx": arg, "arg_offset": plus}
            bd = _bd_for(bds, reg)
            patch = Patch(op.index, at - base, reg, arg, plus, bd)
            if not patch.arg_known:
                warn.add(
                    ("badarg",),
                    at,
                    f"{where} patches kernel argument {arg:,}, outside the kernel's "
                    f"{BUFFER_OBJECTS} buffer objects (0-{BUFFER_OBJECTS - 1}): "
                    "left out of the read regions",
                )
            if bd is None:
                warn.add(
                    ("unpaired",),
                    at,
                    f"{where} patches register {reg:#x}, which no "
                    "earlier buffer descriptor covers: its read region is unknown",
                )
            elif (reg & 0xFFFFFFFF) == bd.reg + 4 and bd.buffer_offset:
                warn.add(
                    ("overwritten",),
                    at,
                    f"{where} replaces the base-address word {bd.buffer_offset:#x} of the "
                    f"descriptor at byte {base + bd.offset:#x}: the region starts at the "
                    "patch's offset alone",
                )
            patches.append(patch)
        ops.append(op)
        at += 4 * words
    if complete and num_ops != len(ops):
        problems.append(Problem(base, f"header counts {num_ops} operations, decoded {len(ops)}"))
    return Stream(
        base,
        device,
        header,
        ops,
        bds,
        patches,
        problems,
        (min(end, len(buf)) - base) // 4,
        complete,
        warn.list(),
    )


def _bd_for(bds: list[BufferDescriptor], reg: int) -> BufferDescriptor | None:
    """The descriptor a patch targets: the latest one whose 8 registers hold ``reg`` (the
    address word), or None: a patch is never paired by guesswork."""
    for bd in reversed(bds):
        if bd.reg <= (reg & 0xFFFFFFFF) < bd.reg + 4 * BD_WORDS:
            return bd
    return None


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
        out.append(
            ArgSummary(
                arg,
                len(regions),
                sum(n for _, n in regions),
                min(o for o, _ in regions),
                max(o + n for o, n in regions),
                runs,
            )
        )
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
        if at + 16 <= len(data) and not_a_txn(data, at):
            if any(data[at:]):
                s.problems.append(
                    Problem(at, f"{len(data) - at:,} bytes after the stream are not a TXN")
                )
            break
    if not streams:
        raise BadInput(f"{len(data)} bytes: too short for a TXN header")
    return streams


def reference_checks(container: str, file_bytes: int, streams: list[Stream]) -> list[RefCheck]:
    """Compare with reference §7's sizes: an ELF of a known size, or a stream of a known word
    count, must have the other numbers the reference gives for it."""
    out: list[RefCheck] = []
    patches = sum(len(s.patches) for s in streams)
    if container.startswith("elf"):
        words = sum(s.words for s in streams)
        for ref in REFERENCE:
            if file_bytes == ref.elf_bytes or words == ref.words:
                by = "ELF size" if file_bytes == ref.elf_bytes else "stream words"
                out.append(RefCheck(ref.what, by, "ELF bytes", ref.elf_bytes, file_bytes))
                out.append(RefCheck(ref.what, by, "words", ref.words, words))
                if ref.patches is not None:
                    out.append(RefCheck(ref.what, by, "patch records", ref.patches, patches))
        return out
    for s in streams:
        for ref in REFERENCE:
            if s.words == ref.words:
                out.append(RefCheck(ref.what, "stream words", "words", ref.words, s.words))
                if ref.patches is not None:
                    out.append(
                        RefCheck(
                            ref.what, "stream words", "patch records", ref.patches, len(s.patches)
                        )
                    )
    return out


# A control stream is small (reference §7's largest ELF is 103,104 bytes); a file hundreds of
# times larger is not one, and is refused before it is read.
MAX_TXN_FILE = 64 << 20


def decode_file(path: str | os.PathLike[str]) -> TxnResult:
    p = Path(path)
    data = read_capped(p, "file", MAX_TXN_FILE)
    container = "raw"
    size = len(data)
    if elf.is_elf(data):
        data = elf.section_bytes(data, ".ctrltext", str(path))
        container = "elf:.ctrltext"
    try:
        streams = decode_bytes(data)
    except BadInput as e:
        raise BadInput(e.message, path) from None
    return TxnResult(
        str(path), container, streams, size, reference_checks(container, size, streams)
    )


# -- building streams (tests, fixtures, documentation) ---------------------------------


def op_write(reg: int, value: int) -> bytes:
    return struct.pack("<IIQII", 0x00, 0, reg, value, 24)


def op_maskwrite(reg: int, value: int, mask: int) -> bytes:
    return struct.pack("<IIQIII", 0x03, 0, reg, value, mask, 28)


def op_blockwrite(reg: int, data: list[int], tile: tuple[int, int] | None = None) -> bytes:
    """BLOCKWRITE; ``tile`` (column, row) goes in word 1, as mlir-aie writes it."""
    word1 = 0 if tile is None else tile[0] & 0xFF | (tile[1] & 0xFF) << 8
    return struct.pack("<IIII", 0x01, word1, reg, 16 + 4 * len(data)) + struct.pack(
        f"<{len(data)}I", *data
    )


def op_bd(reg: int, length_words: int, buffer_offset: int = 0) -> bytes:
    return op_blockwrite(reg, [length_words, buffer_offset, 0, 0, 0, 0, 0, 0])


def op_maskwrite_aie_rt(reg: int, value: int, mask: int) -> bytes:
    """MASKWRITE as aie-rt writes it: ``sizeof(XAie_MaskWrite32Hdr)`` = 32 bytes (8 words)."""
    return struct.pack("<IIQIIII", 0x03, 0, reg, value, mask, 32, 0)


def op_tct(word: int = 0, config: int = 0) -> bytes:
    return struct.pack("<IIII", 0x80, 16, word, config)


def op_sync(
    column: int, row: int, direction: int, channel: int, column_num: int, row_num: int
) -> bytes:
    """TCT sync from its fields, packed as mlir-aie's ``appendSync`` does."""
    return op_tct(
        direction | row << 8 | column << 16, row_num << 8 | column_num << 16 | channel << 24
    )


def op_preempt(level: int) -> bytes:
    return struct.pack("<I", 0x06 | level << 8)


def op_load_pdi(pdi_id: int, size: int, address: int) -> bytes:
    return struct.pack("<IIQ", 0x08 | pdi_id << 16, size, address)


def op_read_regs(addresses: list[int]) -> bytes:
    n = len(addresses)
    return struct.pack(f"<III{n}I", 0x82, 12 + 4 * n, n, *addresses)


def op_patch(reg: int, arg_idx: int, arg_offset: int) -> bytes:
    return struct.pack("<IIIIIIQQQ", 0x81, 48, 0, 40, 0, 0, reg, arg_idx, arg_offset)


def build_stream(
    ops: list[bytes], w0: int = NPU2_W0, cols: int = 4, num_ops: int | None = None
) -> bytes:
    body = b"".join(ops)
    n = len(ops) if num_ops is None else num_ops
    return struct.pack("<IIII", w0, cols | (1 << 8), n, 16 + len(body)) + body
