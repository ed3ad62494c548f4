"""Decode NPU instruction streams ("TXN"): operations, buffer descriptors, patch records.

Layout (reference §7, field positions as in aie-rt's transaction structs and mlir-aie's
``aie/Runtime/TxnEncoding.h``, checked against mlir-aie's own test vectors, tests/npu/data):
a 4-word header ``{u8 major, minor, dev_gen, rows; u8 cols, mem_tile_rows; u16; u32 num_ops;
u32 size}``, word 0 = 0x06040100 on NPU2 (dev_gen 4) and 0x06030100 on NPU1 (dev_gen 3); then
operations, opcode in the low byte of word 0:

=================  ====  =========  ========================================================
op                 code  Size at    fields decoded
=================  ====  =========  ========================================================
WRITE              0x00  byte 20    reg offset (u64) at word 2, value at 4
BLOCKWRITE         0x01  byte 12    reg offset at word 2, data from word 4; a write of one
                                    whole BD at a tile's BD registers is a buffer descriptor,
                                    decoded field by field (``txn_bd``)
MASKWRITE          0x03  byte 24    reg offset at word 2, value at 4, mask at 5
NOOP               0x05  (1 word)   -
PREEMPT            0x06  (1 word)   level in byte 1 of word 0
LOAD_PDI           0x08  (4 words)  id in the high half of word 0, size at 1, address (u64)
CREATE_SCRATCHPAD  0x0A  (4 words)  usage type in byte 1, size (bytes) at word 1, the
                                    scratchpad's DDR address (u64, patched by the runtime)
UPDATE_STATE_TBL   0x0B  (2 words)  state-table index, func in bytes 1-2, func_arg at word 1
UPDATE_REG         0x0C  (3 words)  state-table index in byte 1, func in byte 2, func_arg at
                                    word 1, the register it updates at word 2
UPDATE_SCRATCH     0x0D  (1 word)   -
TCT sync           0x80  byte 4     word 2 = direction | row << 8 | column << 16, word 3 =
                                    row_num << 8 | column_num << 16 | channel << 24
DDR_PATCH          0x81  byte 4     reg addr (u64) at word 6, arg_idx (u64) at word 8,
                                    arg_offset (u64) at words 10-11
READ_REGS          0x82  byte 4     count at word 2, then the addresses, in one of the two
                                    forms mlir-aie has emitted (below)
=================  ====  =========  ========================================================

Opcodes 0x09-0x0F follow the numbering mlir-aie's TxnEncoding.h says the firmware uses
(CREATE_SCRATCHPAD = 0x0A, UPDATE_REG = 0x0C); aie-rt's older ``xaie_txn.h`` numbers 0x09 and
0x0A as CONFIG_SHIMDMA_BD / _DMABUF_BD, which no mlir-aie stream contains.

**READ_REGS forms**, told apart by the op's own Size for its count n: ``12 + 4n`` bytes holds
32-bit addresses right after the count (mlir-aie's first ``npu.read_reg`` lowering: 16 bytes
for one register); ``16 + 8n`` bytes holds a padding word, then 64-bit addresses low half first
(its current lowering, 24 bytes for one register; the layout of aie-rt's ``read_register_op_t
{u32 count; {u64 address} data[]}``). For every n the two sizes differ; any other Size stops
the stream. Each stream records which forms it used.

A register address is ``column << 25 | row << 20 | tile-local address (20 bits)`` on both
devices (mlir-aie's ``getColumnShift``/``getRowShift`` for AIE2 and AIE2P).

Every sized op carries its own byte size (aie-rt's ``Size`` fields); the decoder advances by
it, so an op longer than the reference says (aie-rt's ``XAie_MaskWrite32Hdr`` is 32 bytes)
cannot make it lose sync. A Size that disagrees with the reference's word count is a warning
with its offset; a Size of 0 (a stream assembled from the reference alone) falls back on the
reference's count; an impossible Size (too small for the op's fields, not whole words, past
the stream) stops the stream with an error. Bytes that do not start with a TXN header are
refused before any decoding.

**Buffer descriptors and read regions** (the seed's descriptor walk). A DDR patch makes a
shim BD read or write a kernel argument's buffer at ``arg_offset``: the runtime writes the
buffer's address plus ``arg_offset`` into the patched register (the BD's address words 1-2),
so the BD's own address is replaced, not added; a nonzero one is reported. Each patch is
paired with the latest BD whose registers hold the patched register (never guessed); the bytes
it touches come from that BD's *decoded* fields — buffer length, the d0/d1/d2 wraps and
strides, the iteration stride/wrap/current — for as many runs as the task-queue write that
started it asks (repeat count + 1), not from a fixed span. The task-queue register the BD id
is written to gives the DMA direction and channel: a shim MM2S channel reads the host buffer,
S2MM writes it. A BD changed after its block write (a WRITE, a partial block write, an
UPDATE_REG adding a scratchpad value at run time) has no static region: its patches are
reported and left out. A scratchpad (CREATE_SCRATCHPAD) is the runtime's own buffer, not a
kernel argument: its state-table entries feed UPDATE_REG ops and it is listed apart from the
arguments' regions.

An unknown opcode is reported with its byte offset; custom ops (>= 0x80) carry their size, so
decoding skips them and goes on, any other unknown opcode stops the stream there. Reference
§7 also gives the sizes of the runtime's streams and ELFs (``REFERENCE``); a decoded stream or
ELF of one of those sizes is checked against the others.
"""

from __future__ import annotations

import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BadInput
from ..inputs import read_capped
from . import elf, txn_bd
from .txn_bd import SHIM, BdLayout

NPU2_W0 = 0x06040100
NPU1_W0 = 0x06030100
DEVICES = {NPU1_W0: "npu1", NPU2_W0: "npu2"}  # header word 0 -> device (mlir-aie vectors)
HEADER_WORDS = 4
BUFFER_OBJECTS = 5  # the seed's kernel ABI: arguments 0..4 are buffer objects
COL_SHIFT, ROW_SHIFT, LOCAL_MASK = 25, 20, 0xFFFFF  # AIE2 / AIE2P register addresses
STATE_TABLE_FUNCS = {0: "mul", 1: "incr", 2: "decr"}  # aie-rt XAie_StateTableFuncType
READ_REGS_FORMS = {
    "u32": "32-bit addresses, 12 + 4n bytes",
    "u64": "64-bit addresses, 16 + 8n bytes",
}


def tile_address(reg: int) -> dict[str, int]:
    """Column, row and tile-local address of a register address (``col << 25 | row << 20 |
    local``), as mlir-aie composes it for write32/maskwrite32/blockwrite."""
    reg &= 0xFFFFFFFF
    return {"column": reg >> COL_SHIFT, "row": (reg >> ROW_SHIFT) & 0x1F, "local": reg & LOCAL_MASK}


@dataclass(frozen=True)
class OpFormat:
    name: str
    ref_words: int  # the reference's word count (§7); a fixed op's own count
    size_at: int | None  # byte offset of the op's own Size field (aie-rt); None: fixed
    min_bytes: int  # the smallest size that holds the fields decoded here (fixed: its size)


OPS = {
    0x00: OpFormat("WRITE", 6, 20, 24),  # XAie_Write32Hdr
    0x01: OpFormat("BLOCKWRITE", 12, 12, 16),  # XAie_BlockWrite32Hdr + data (12 = a BD)
    0x03: OpFormat("MASKWRITE", 7, 24, 28),  # XAie_MaskWrite32Hdr (sizeof is 32 in aie-rt)
    0x05: OpFormat("NOOP", 1, None, 4),  # XAie_NoOpHdr
    0x06: OpFormat("PREEMPT", 1, None, 4),  # one word, no Size field (mlir-aie vectors)
    0x08: OpFormat("LOAD_PDI", 4, None, 16),  # four words, no Size field (mlir-aie vectors)
    0x0A: OpFormat("CREATE_SCRATCHPAD", 4, None, 16),  # XAie_CreateScratchpadHdr
    0x0B: OpFormat("UPDATE_STATE_TABLE", 2, None, 8),  # XAie_UpdateStateHdr
    0x0C: OpFormat("UPDATE_REG", 3, None, 12),  # XAie_UpdateRegHdr
    0x0D: OpFormat("UPDATE_SCRATCH", 1, None, 4),  # XAie_UpdateScratchHdr
    0x80: OpFormat("TCT", 4, 4, 16),  # XAie_CustomOpHdr + tct_op_t
    0x81: OpFormat("DDR_PATCH", 12, 4, 48),  # XAie_CustomOpHdr + patch_op_t
    0x82: OpFormat("READ_REGS", 4, 4, 12),  # XAie_CustomOpHdr + read_register_op_t
}
SIZED_FREELY = ("BLOCKWRITE", "READ_REGS")  # their word count depends on their data


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
class QueuePush:
    """A write of a BD id into a DMA channel's task queue: what starts a transfer."""

    op_index: int
    offset: int
    column: int
    row: int
    kind: str  # tile kind (shim / memtile / core)
    direction: str  # "MM2S" (memory to stream: reads memory) | "S2MM" (writes memory)
    channel: int
    bd_id: int
    repeat_count: int  # the BD runs repeat_count + 1 times
    token: bool


@dataclass
class BufferDescriptor:
    """One block write of a whole BD, decoded for its tile kind and device."""

    op_index: int
    offset: int
    reg: int
    length_words: int
    buffer_offset: int  # the base address the BD words give, in bytes
    words: list[int]
    device: str = "npu2"
    kind: str = SHIM
    column: int = 0
    row: int = 0
    bd_id: int = 0
    fields: dict[str, int] = field(default_factory=dict)
    pushes: list[QueuePush] = field(default_factory=list)
    changes: list[str] = field(default_factory=list)  # later writes to its registers (first few)
    _access: txn_bd.Access | None = field(default=None, repr=False, compare=False)

    @property
    def length_bytes(self) -> int:
        return 4 * self.length_words

    @property
    def layout(self) -> BdLayout:
        return txn_bd.LAYOUTS[(self.device, self.kind)]

    @property
    def access(self) -> txn_bd.Access:
        """The transfer its fields describe (computed once: the fields are its block write)."""
        if self._access is None:
            self._access = txn_bd.access_of(self.kind, self.fields)
        return self._access

    @property
    def runs(self) -> int:
        """How many times the task queue runs it (1 when no queue write names it)."""
        return sum(p.repeat_count + 1 for p in self.pushes) or 1

    @property
    def direction(self) -> str | None:
        dirs = {p.direction for p in self.pushes}
        return dirs.pop() if len(dirs) == 1 else ("mixed" if dirs else None)

    def to_json(self) -> dict[str, Any]:
        acc = self.access
        f = self.fields
        burst = txn_bd.BURST_BYTES[self.device].get(f.get("burst_length", -1))
        return {
            "op_index": self.op_index,
            "offset": self.offset,
            "reg": self.reg,
            "device": self.device,
            "kind": self.kind,
            "column": self.column,
            "row": self.row,
            "bd_id": self.bd_id,
            "words": self.words,
            "fields": dict(f),
            "length_words": self.length_words,
            "length_bytes": self.length_bytes,
            "base_address": self.buffer_offset,
            "dims": [{"wrap": d.wrap, "stride": d.stride} for d in acc.dims],
            "iteration": {
                "wrap": acc.iteration_wrap,
                "stride": acc.iteration_stride,
                "current": acc.iteration_current,
            },
            "burst_length_bytes": burst if self.kind == SHIM else None,
            "valid": bool(f.get("valid_bd")),
            "next_bd": f["next_bd"] if f.get("use_next_bd") else None,
            "direction": self.direction,
            "pushes": self.pushes,
            "runs": self.runs,
            "changes": self.changes,
        }


@dataclass
class Patch:
    op_index: int
    offset: int
    reg: int
    arg_idx: int
    arg_offset: int
    bd: BufferDescriptor | None
    unknown_region: str | None = None  # why the region is not known statically

    @property
    def arg_known(self) -> bool:
        """Whether ``arg_idx`` names one of the kernel's buffer objects."""
        return 0 <= self.arg_idx < BUFFER_OBJECTS

    @property
    def targets_address(self) -> bool:
        """Whether it patches its BD's address word (a shim BD's word 1)."""
        bd = self.bd
        return bd is not None and (self.reg & 0xFFFFFFFF) == bd.reg + 4 * bd.layout.address_word

    @property
    def region(self) -> tuple[int, int] | None:
        """(offset into the argument's buffer, bytes moved per run): the patch replaces the
        descriptor's base address, so the transfer starts at ``arg_offset`` alone."""
        if self.bd is None or not self.arg_known or self.unknown_region:
            return None
        return self.arg_offset, self.bd.length_bytes

    @property
    def access(self) -> str:
        """ "read" (an MM2S channel runs the BD), "write" (S2MM) or "unknown" (no queue write)."""
        d = self.bd.direction if self.bd else None
        return {"MM2S": "read", "S2MM": "write"}.get(d or "", "unknown")

    def spans(self) -> list[tuple[int, int]] | None:
        """The contiguous byte spans of the argument's buffer the BD touches over all its runs,
        from its decoded length, wraps and strides; None when unknown or too many to list."""
        if self.region is None or self.bd is None:
            return None
        return txn_bd.spans(self.bd.access, self.arg_offset, self.bd.runs)

    def to_json(self) -> dict[str, Any]:
        return {
            "op_index": self.op_index,
            "offset": self.offset,
            "reg": self.reg,
            "arg_idx": self.arg_idx,
            "arg_offset": self.arg_offset,
            "bd_offset": self.bd.offset if self.bd else None,
            "bd": self.bd,
            "access": self.access,
            "region": self.region,
            "unknown_region": self.unknown_region,
        }


@dataclass
class Scratchpad:
    """A CREATE_SCRATCHPAD: a buffer of the runtime's (not a kernel argument) whose 32-bit
    state-table entries UPDATE_REG ops add into registers at run time."""

    op_index: int
    offset: int
    usage_type: int
    size: int
    scratch_offset: int
    readers: int = 0
    entries_read: list[int] = field(default_factory=list)

    @property
    def entries(self) -> int:
        return self.size // 4


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
    access: str = "unknown"  # read | write | unknown (see Patch.access)
    bounds_only: int = 0  # patches with too many spans to list: their [lo, hi) stands in


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
    pushes: list[QueuePush] = field(default_factory=list)
    scratchpads: list[Scratchpad] = field(default_factory=list)
    read_regs_forms: dict[str, int] = field(default_factory=dict)  # "u32"/"u64" -> ops

    @property
    def unpaired(self) -> int:
        return sum(p.bd is None for p in self.patches)

    def op_counts(self) -> dict[str, int]:
        return dict(Counter(op.name for op in self.ops))

    def bd_counts(self) -> dict[str, int]:
        return dict(Counter(b.kind for b in self.bds))

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


MAX_CHANGES = 8  # later writes to one BD's registers that are listed
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


class _Decoder:
    """One stream's decoding state: what was decoded so far and the warnings."""

    def __init__(self, buf: bytes, base: int, device: str, mem_tile_rows: int) -> None:
        self.buf = buf
        self.base = base
        self.device = device
        self.mem_tile_rows = mem_tile_rows
        self.warn = _Warnings()
        self.problems: list[Problem] = []
        self.ops: list[Op] = []
        self.bds: list[BufferDescriptor] = []
        self.patches: list[Patch] = []
        self.pushes: list[QueuePush] = []
        self.scratchpads: list[Scratchpad] = []
        self.forms: Counter[str] = Counter()
        self.latest: dict[int, BufferDescriptor] = {}  # BD base register -> latest BD there

    # -- registers ---------------------------------------------------------------------

    def _layout(self, reg: int) -> tuple[dict[str, int], BdLayout]:
        t = tile_address(reg)
        return t, txn_bd.layout_for(self.device, t["row"], self.mem_tile_rows)

    def _bd_at(self, reg: int) -> BufferDescriptor | None:
        """The latest BD whose registers hold ``reg``: BDs sit at their slots' bases, so one
        look-up finds it (a patch is never paired by guesswork)."""
        t, lay = self._layout(reg)
        slot = lay.slot(t["local"])
        if slot is None:
            return None
        base = (reg & 0xFFFFFFFF) - 4 * slot[1]
        return self.latest.get(base)

    def _changed(self, reg: int, what: str) -> None:
        """A write to a register of an already written BD (not its DDR patch)."""
        bd = self._bd_at(reg)
        if bd is None:
            return
        if len(bd.changes) >= MAX_CHANGES:  # the first few say enough; a stream may hold millions
            return
        word = ((reg & 0xFFFFFFFF) - bd.reg) // 4
        names = [f.name for f in bd.layout.fields if f.word == word]
        bd.changes.append(f"{what} (word {word}: {', '.join(names)})")

    def _queue(self, op: Op, at: int) -> None:
        """A WRITE to a DMA task-queue register starts the BD it names."""
        t, lay = self._layout(op.fields["reg"])
        q = txn_bd.QUEUES[lay.kind]
        chan = q.channel(t["local"])
        if chan is None:
            return
        v = q.decode(op.fields["value"])
        push = QueuePush(
            op.index,
            at - self.base,
            t["column"],
            t["row"],
            lay.kind,
            chan[0],
            chan[1],
            v["start_bd_id"],
            v["repeat_count"],
            bool(v["enable_token_issue"]),
        )
        self.pushes.append(push)
        # the BD and the chain it starts (use_next_bd), as written when the queue is written
        seen: set[int] = set()
        bd_id: int | None = push.bd_id
        while bd_id is not None and bd_id not in seen:
            seen.add(bd_id)
            reg = (
                (t["column"] << COL_SHIFT)
                | (t["row"] << ROW_SHIFT)
                | (lay.base + lay.stride * bd_id)
            )
            bd = self._bd_at(reg)
            if bd is None or bd.reg != reg:
                break
            bd.pushes.append(push)
            bd_id = bd.fields["next_bd"] if bd.fields.get("use_next_bd") else None

    # -- ops -----------------------------------------------------------------------------

    def blockwrite(self, op: Op, at: int, words: int) -> None:
        buf = self.buf
        reg, tile_word = _w(buf, at + 8), _w(buf, at + 4)
        t, lay = self._layout(reg)
        op.fields = {"reg": reg, **t, "data_words": words - 4}
        if tile_word:  # mlir-aie sets word 1 = column | row << 8 when the op names a tile
            op.fields["tile_column"], op.fields["tile_row"] = tile_word & 0xFF, tile_word >> 8
        op.payload = list(struct.unpack_from(f"<{words - 4}I", buf, at + 16))
        slot = lay.slot(t["local"])
        if slot is not None and slot[1] == 0 and len(op.payload) == lay.words:
            f = lay.decode(op.payload)
            bd = BufferDescriptor(
                op.index,
                at - self.base,
                reg,
                f["buffer_length"],
                0,
                op.payload,
                self.device,
                lay.kind,
                t["column"],
                t["row"],
                slot[0],
                f,
            )
            bd.buffer_offset = bd.access.base
            self.bds.append(bd)
            self.latest[reg & 0xFFFFFFFF] = bd
            op.fields["bd_id"] = slot[0]
        else:  # a write into BD registers that is not one whole BD changes the BDs there
            lo = max(t["local"], lay.base)
            hi = min(t["local"] + 4 * len(op.payload), lay.base + lay.count * lay.stride)
            for local in range(lo, hi, 4):
                self._changed(reg - t["local"] + local, f"BLOCKWRITE at byte {at:#x}")

    def patch(self, op: Op, at: int, where: str) -> None:
        buf, warn = self.buf, self.warn
        reg, arg, plus = _q(buf, at + 24), _q(buf, at + 32), _q(buf, at + 40)
        op.fields = {"reg": reg, "arg_idx": arg, "arg_offset": plus}
        bd = self._bd_at(reg)
        patch = Patch(op.index, at - self.base, reg, arg, plus, bd)
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
        elif not patch.targets_address:
            word = ((reg & 0xFFFFFFFF) - bd.reg) // 4
            patch.unknown_region = f"it patches word {word}, not the BD's address word"
            warn.add(
                ("notaddr",),
                at,
                f"{where} patches word {word} of the {bd.kind} BD at byte "
                f"{self.base + bd.offset:#x}, not its address word "
                f"{bd.layout.address_word}: its region is unknown",
            )
        elif bd.buffer_offset:
            warn.add(
                ("overwritten",),
                at,
                f"{where} replaces the base-address word {bd.buffer_offset:#x} of the "
                f"descriptor at byte {self.base + bd.offset:#x}: the region starts at the "
                "patch's offset alone",
            )
        self.patches.append(patch)

    def read_regs(self, op: Op, at: int, words: int, where: str) -> bool:
        """Decode READ_REGS in the form its Size names; False (problem recorded) if neither."""
        buf = self.buf
        count = _w(buf, at + 8)
        if words == 3 + count:
            form = "u32"
            op.payload = list(struct.unpack_from(f"<{count}I", buf, at + 12))
        elif words == 4 + 2 * count:
            form = "u64"
            if _w(buf, at + 12):
                self.warn.add(
                    ("rrpad",),
                    at,
                    f"{where}: the padding word before its 64-bit addresses is "
                    f"{_w(buf, at + 12):#x}, not 0",
                )
            op.payload = list(struct.unpack_from(f"<{count}Q", buf, at + 16))
        else:
            self.problems.append(
                Problem(
                    at,
                    f"{where} counts {count:,} registers in {words} words: its Size fits "
                    f"neither form ({3 + count} words with 32-bit addresses, "
                    f"{4 + 2 * count} with 64-bit ones)",
                )
            )
            return False
        op.fields = {"count": count, "address_bits": 32 if form == "u32" else 64}
        self.forms[form] += 1
        return True

    def create_scratchpad(self, op: Op, at: int) -> None:
        w0 = _w(self.buf, at)
        pad = Scratchpad(
            op.index, at - self.base, (w0 >> 8) & 0xFF, _w(self.buf, at + 4), _q(self.buf, at + 8)
        )
        op.fields = {
            "usage_type": pad.usage_type,
            "size": pad.size,
            "entries": pad.entries,
            "scratch_offset": pad.scratch_offset,
        }
        self.scratchpads.append(pad)

    def update_reg(self, op: Op, at: int, where: str) -> None:
        w0 = _w(self.buf, at)
        reg = _w(self.buf, at + 8)
        idx, func = (w0 >> 8) & 0xFF, (w0 >> 16) & 0xFF
        op.fields = {
            "state_table_idx": idx,
            "func": func,
            "func_arg": _w(self.buf, at + 4),
            "reg": reg,
            **tile_address(reg),
        }
        pad = self.scratchpads[-1] if self.scratchpads else None
        if pad is None:
            self.warn.add(
                ("nopad",),
                at,
                f"{where} reads state-table entry {idx}, but no CREATE_SCRATCHPAD precedes it",
            )
        else:
            pad.readers += 1
            if idx not in pad.entries_read:
                pad.entries_read.append(idx)
            if idx >= pad.entries:
                self.warn.add(
                    ("padrange",),
                    at,
                    f"{where} reads state-table entry {idx}, past the {pad.entries} entries "
                    f"of the scratchpad at byte {self.base + pad.offset:#x}",
                )
        fname = STATE_TABLE_FUNCS.get(func, f"func {func}")
        self._changed(
            reg, f"UPDATE_REG at byte {at:#x} ({fname} by scratchpad entry {idx} at run time)"
        )

    # -- the stream ------------------------------------------------------------------------

    def finish(self) -> list[Problem]:
        """Patches whose BD changed after its block write: no static region (warned)."""
        for p in self.patches:
            if p.bd is not None and p.bd.changes and p.unknown_region is None:
                p.unknown_region = f"its BD was changed after its block write: {p.bd.changes[0]}"
                self.warn.add(
                    ("changed",),
                    self.base + p.offset,
                    f"DDR_PATCH at byte {self.base + p.offset:#x}: the BD at byte "
                    f"{self.base + p.bd.offset:#x} was changed after its block write by "
                    f"{p.bd.changes[0]}: its region is not known statically, left out of "
                    "the read regions",
                )
        return self.warn.list()


def decode_stream(buf: bytes, base: int = 0) -> Stream:
    """Decode one TXN starting at byte ``base`` of ``buf``; ``BadInput`` if there is no TXN
    header there (see ``not_a_txn``)."""
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
    d = _Decoder(buf, base, device, header["mem_tile_rows"])
    problems, warn, ops = d.problems, d.warn, d.ops
    end = base + size
    if size < 16 or size % 4:
        problems.append(Problem(base, f"header size {size} is not a whole number of words"))
        end = len(buf)
    elif end > len(buf):
        problems.append(
            Problem(base, f"header says {size:,} bytes, only {len(buf) - base:,} remain")
        )
        end = len(buf)
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
            if name not in SIZED_FREELY and words != fmt.ref_words:
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
            d._changed(reg, f"{name} at byte {at:#x}")
            if name == "WRITE":
                d._queue(op, at)
        elif name == "BLOCKWRITE":
            d.blockwrite(op, at, words)
        elif name == "PREEMPT":
            op.fields = {"level": (_w(buf, at) >> 8) & 0xFF}
        elif name == "LOAD_PDI":
            op.fields = {
                "id": _w(buf, at) >> 16,
                "size": _w(buf, at + 4),
                "address": _q(buf, at + 8),
            }
        elif name == "CREATE_SCRATCHPAD":
            d.create_scratchpad(op, at)
        elif name == "UPDATE_REG":
            d.update_reg(op, at, where)
        elif name == "UPDATE_STATE_TABLE":
            w = _w(buf, at)
            op.fields = {
                "state_table_idx": (w >> 8) & 0xFF,
                "func": (w >> 16) & 0xFF,
                "func_arg": _w(buf, at + 4),
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
            if not d.read_regs(op, at, words, where):
                complete = False
                break
        elif name == "DDR_PATCH":
            d.patch(op, at, where)
        ops.append(op)
        at += 4 * words
    if complete and num_ops != len(ops):
        problems.append(Problem(base, f"header counts {num_ops} operations, decoded {len(ops)}"))
    warnings = d.finish()
    return Stream(
        base,
        device,
        header,
        ops,
        d.bds,
        d.patches,
        problems,
        (min(end, len(buf)) - base) // 4,
        complete,
        warnings,
        d.pushes,
        d.scratchpads,
        dict(d.forms),
    )


def summarise(patches: list[Patch]) -> list[ArgSummary]:
    """Per kernel argument and access (read / write / unknown): the contiguous spans each
    patched BD touches — from its decoded length, wraps, strides, iteration and runs — in
    stream order, folded into equal-length, equal-stride runs."""
    by_key: dict[tuple[int, str], list[tuple[int, int]]] = {}
    counts: Counter[tuple[int, str]] = Counter()
    bounded: Counter[tuple[int, str]] = Counter()
    for p in patches:
        if p.region is None or p.bd is None:
            continue
        key = (p.arg_idx, p.access)
        sp = p.spans()
        if sp is None:  # too many spans to list: the bounds stand in, and say so
            lo, hi = txn_bd.bounds(p.bd.access, p.arg_offset, p.bd.runs)
            sp = [(lo, hi - lo)]
            bounded[key] += 1
        elif not sp:  # a zero-length transfer: where it starts
            sp = [(p.arg_offset, 0)]
        by_key.setdefault(key, []).extend(sp)
        counts[key] += 1
    out = []
    order = {"read": 0, "write": 1, "unknown": 2}
    for key in sorted(by_key, key=lambda k: (k[0], order.get(k[1], 3))):
        regions = by_key[key]
        runs: list[Run] = []
        for off, length in regions:
            last = runs[-1] if runs else None
            if last and last.length == length:
                if last.count == 1:  # stride 0: the same bytes again (a repeated run)
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
                key[0],
                counts[key],
                sum(n for _, n in regions),
                min(o for o, _ in regions),
                max(o + n for o, n in regions),
                runs,
                key[1],
                bounded[key],
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


def op_read_regs(addresses: list[int], form: str = "u32") -> bytes:
    """READ_REGS in either form mlir-aie has emitted: ``"u32"`` (12 + 4n bytes, its first
    lowering) or ``"u64"`` (16 + 8n bytes: a padding word, then 64-bit addresses)."""
    n = len(addresses)
    if form == "u32":
        return struct.pack(f"<III{n}I", 0x82, 12 + 4 * n, n, *addresses)
    if form == "u64":
        return struct.pack(f"<IIII{n}Q", 0x82, 16 + 8 * n, n, 0, *addresses)
    raise ValueError(f"READ_REGS form {form!r}: 'u32' or 'u64'")


def op_noop() -> bytes:
    return struct.pack("<I", 0x05)


def op_create_scratchpad(size: int, usage_type: int = 0, scratch_offset: int = 0) -> bytes:
    """CREATE_SCRATCHPAD: ``size`` bytes of state table; the DDR address is the runtime's."""
    return struct.pack("<IIQ", 0x0A | (usage_type & 0xFF) << 8, size, scratch_offset)


def op_update_reg(reg: int, state_table_idx: int, func: int = 0, func_arg: int = 0) -> bytes:
    """UPDATE_REG: update register ``reg`` from state-table entry ``state_table_idx``."""
    return struct.pack(
        "<III", 0x0C | (state_table_idx & 0xFF) << 8 | (func & 0xFF) << 16, func_arg, reg
    )


def op_update_state_table(state_table_idx: int, func: int = 0, func_arg: int = 0) -> bytes:
    return struct.pack("<II", 0x0B | (state_table_idx & 0xFF) << 8 | (func & 0xFF) << 16, func_arg)


def op_bd_fields(
    reg: int,
    fields: dict[str, int],
    device: str = "npu2",
    mem_tile_rows: int = 1,
    tile: tuple[int, int] | None = None,
) -> bytes:
    """A BD block write from named fields (``txn_bd``'s layout for the tile ``reg`` is on)."""
    t = tile_address(reg)
    lay = txn_bd.layout_for(device, t["row"], mem_tile_rows)
    return op_blockwrite(reg, lay.encode(fields), tile)


def op_queue_push(
    column: int,
    row: int,
    direction: str,
    channel: int,
    bd_id: int,
    repeat_count: int = 0,
    token: bool = False,
    mem_tile_rows: int = 1,
) -> bytes:
    """The WRITE to a channel's task queue that starts BD ``bd_id``."""
    q = txn_bd.QUEUES[txn_bd.tile_kind(row, mem_tile_rows)]
    reg = column << COL_SHIFT | row << ROW_SHIFT | q.register(direction, channel)
    return op_write(reg, q.encode(bd_id, repeat_count, token))


def op_patch(reg: int, arg_idx: int, arg_offset: int) -> bytes:
    return struct.pack("<IIIIIIQQQ", 0x81, 48, 0, 40, 0, 0, reg, arg_idx, arg_offset)


def build_stream(
    ops: list[bytes], w0: int = NPU2_W0, cols: int = 4, num_ops: int | None = None
) -> bytes:
    body = b"".join(ops)
    n = len(ops) if num_ops is None else num_ops
    return struct.pack("<IIII", w0, cols | (1 << 8), n, 16 + len(body)) + body
