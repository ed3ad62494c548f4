"""Buffer descriptors and DMA task queues of the NPU1 / NPU2 tiles, field by field.

A block write that lands on a tile's BD registers programs one DMA transfer; the write that
puts its BD id into a channel's task queue starts it. Field positions are aie-rt's register
definitions (``driver/src/global/xaiemlgbl_params.h`` for AIE-ML = NPU1 and
``xaie2pgbl_params.h`` for AIE2P = NPU2, release/main_aig branch): the shim tile's
``NOC_MODULE_DMA_BD*``, the mem tile's ``MEM_TILE_MODULE_DMA_BD*`` and the core tile's
``MEMORY_MODULE_DMA_BD*``. The two devices place every field at the same bits; they differ in
the mem tile's padding field names (AIE-ML "zero", AIE2P "pad", named ``*_pad_*`` here) and in
the burst lengths mlir-aie allows (NPU2 adds 512 B).

Encodings (aie-rt ``xaie_dma_aieml.c`` and ``xaie_dma.c``): lengths are in 32-bit words;
``*_stepsize`` fields hold stride - 1 (in words) and ``iteration_wrap`` holds wrap - 1;
``d*_wrap`` hold the wrap itself, 0 meaning the dimension does not wrap (mlir-aie lowers a
contiguous transfer to wraps of 0, "linear mode"); a task-queue word holds the start BD id,
``repeat_count`` = runs - 1 and the token bit. A shim BD's address is a byte address (bits
31:2 in word 1, 47:32 in word 2); mem and core tile BDs hold word addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SHIM, MEMTILE, CORE = "shim", "memtile", "core"
WORD = 4  # bytes per DMA address unit (32-bit words on every AIE-ML tile)


@dataclass(frozen=True)
class Field:
    name: str
    word: int
    lsb: int
    width: int

    @property
    def mask(self) -> int:
        return (1 << self.width) - 1

    def place(self, value: int) -> int:
        if not 0 <= value <= self.mask:
            raise ValueError(f"{self.name} = {value} does not fit in {self.width} bits")
        return value << self.lsb


def _fields(spec: str) -> tuple[Field, ...]:
    """``"word: name@lsb:width ..."`` lines, as aie-rt's ``*_LSB``/``*_WIDTH`` give them."""
    out = []
    for line in spec.strip().splitlines():
        word, names = line.split(":", 1)
        for item in names.split():
            name, pos = item.split("@")
            lsb, width = pos.split(":")
            out.append(Field(name, int(word), int(lsb), int(width)))
    return tuple(sorted(out, key=lambda f: (f.word, -f.lsb)))  # the order decode lists them


@dataclass(frozen=True)
class BdLayout:
    """Where one tile kind's BDs live and how their words are laid out."""

    kind: str
    base: int  # tile-local address of BD 0
    stride: int  # bytes between BDs
    count: int  # BDs per tile
    words: int  # words per BD
    fields: tuple[Field, ...]
    address_word: int  # the word a DDR patch writes (shim) / the base-address word
    source: str

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)

    def slot(self, local: int) -> tuple[int, int] | None:
        """(BD id, word) of a tile-local register address, or None outside the BDs."""
        off = local - self.base
        if off < 0 or off % 4 or off >= self.count * self.stride:
            return None
        bd, byte = divmod(off, self.stride)
        return (bd, byte // 4) if byte < 4 * self.words else None

    def decode(self, words: list[int]) -> dict[str, int]:
        return {f.name: (words[f.word] >> f.lsb) & f.mask for f in self.fields}

    def encode(self, values: dict[str, int]) -> list[int]:
        """The BD words for named field values (fields not named are 0)."""
        unknown = set(values) - {f.name for f in self.fields}
        if unknown:
            raise ValueError(f"no field {sorted(unknown)} in a {self.kind} BD")
        words = [0] * self.words
        for f in self.fields:
            words[f.word] |= f.place(values.get(f.name, 0))
        return words


_LOCKS_4BIT = (
    "lock_rel_value@18:7 lock_rel_id@13:4 lock_acq_enable@12:1 lock_acq_value@5:7 lock_acq_id@0:4"
)

SHIM_BD = BdLayout(
    SHIM,
    0x1D000,
    0x20,
    16,
    8,
    _fields(f"""
0: buffer_length@0:32
1: base_address_low@2:30
2: enable_packet@30:1 out_of_order_bd_id@24:6 packet_id@19:5 packet_type@16:3 base_address_high@0:16
3: secure_access@30:1 d0_wrap@20:10 d0_stepsize@0:20
4: burst_length@30:2 d1_wrap@20:10 d1_stepsize@0:20
5: smid@28:4 axcache@24:4 axqos@20:4 d2_stepsize@0:20
6: iteration_current@26:6 iteration_wrap@20:6 iteration_stepsize@0:20
7: tlast_suppress@31:1 next_bd@27:4 use_next_bd@26:1 valid_bd@25:1 {_LOCKS_4BIT}
"""),
    1,
    "aie-rt NOC_MODULE_DMA_BD0_0..7 (0x1D000), 16 BDs 0x20 apart",
)

MEMTILE_BD = BdLayout(
    MEMTILE,
    0xA0000,
    0x20,
    48,
    8,
    _fields("""
0: enable_packet@31:1 packet_type@28:3 packet_id@23:5 out_of_order_bd_id@17:6 buffer_length@0:17
1: d0_pad_before@26:6 next_bd@20:6 use_next_bd@19:1 base_address@0:19
2: tlast_suppress@31:1 d0_wrap@17:10 d0_stepsize@0:17
3: d1_pad_before@27:5 d1_wrap@17:10 d1_stepsize@0:17
4: enable_compression@31:1 d2_pad_before@27:4 d2_wrap@17:10 d2_stepsize@0:17
5: d2_pad_after@28:4 d1_pad_after@23:5 d0_pad_after@17:6 d3_stepsize@0:17
6: iteration_current@23:6 iteration_wrap@17:6 iteration_stepsize@0:17
7: valid_bd@31:1 lock_rel_value@24:7 lock_rel_id@16:8 lock_acq_enable@15:1 lock_acq_value@8:7 lock_acq_id@0:8
"""),
    1,
    "aie-rt MEM_TILE_MODULE_DMA_BD0_0..7 (0xA0000), 48 BDs 0x20 apart",
)

CORE_BD = BdLayout(
    CORE,
    0x1D000,
    0x20,
    16,
    6,
    _fields(f"""
0: base_address@14:14 buffer_length@0:14
1: enable_compression@31:1 enable_packet@30:1 out_of_order_bd_id@24:6 packet_id@19:5 packet_type@16:3
2: d1_stepsize@13:13 d0_stepsize@0:13
3: d1_wrap@21:8 d0_wrap@13:8 d2_stepsize@0:13
4: iteration_current@19:6 iteration_wrap@13:6 iteration_stepsize@0:13
5: tlast_suppress@31:1 next_bd@27:4 use_next_bd@26:1 valid_bd@25:1 {_LOCKS_4BIT}
"""),
    0,
    "aie-rt MEMORY_MODULE_DMA_BD0_0..5 (0x1D000), 16 BDs 0x20 apart",
)

# NPU1 (AIE-ML) and NPU2 (AIE2P) place every BD field at the same bits (aie-rt, both headers)
LAYOUTS: dict[tuple[str, str], BdLayout] = {
    (dev, lay.kind): lay for dev in ("npu1", "npu2") for lay in (SHIM_BD, MEMTILE_BD, CORE_BD)
}

# mlir-aie's shim burst encodings (getShimBurstEncodingsAndLengths): code -> bytes
BURST_BYTES = {"npu1": {0: 64, 1: 128, 2: 256}, "npu2": {0: 64, 1: 128, 2: 256, 3: 512}}


def tile_kind(row: int, mem_tile_rows: int = 1) -> str:
    """Row 0 is the shim, the next ``mem_tile_rows`` rows mem tiles, the rest core tiles."""
    if row == 0:
        return SHIM
    return MEMTILE if row <= max(mem_tile_rows, 1) else CORE


def layout_for(device: str, row: int, mem_tile_rows: int = 1) -> BdLayout:
    return LAYOUTS[(device, tile_kind(row, mem_tile_rows))]


# -- task queues --------------------------------------------------------------------------


@dataclass(frozen=True)
class QueueLayout:
    """A tile's DMA channels: ``*_CTRL`` at ``base + 8·i`` and the task queue 4 bytes on;
    S2MM channels first, then MM2S (aie-rt ``*_DMA_S2MM_0_CTRL`` … ``MM2S_*_START_QUEUE``)."""

    kind: str
    s2mm_base: int
    mm2s_base: int
    channels: int
    bd_id_bits: int

    def channel(self, local: int) -> tuple[str, int] | None:
        """(direction, channel) of a task-queue register address, or None."""
        for direction, base in (("S2MM", self.s2mm_base), ("MM2S", self.mm2s_base)):
            off = local - base - 4
            if 0 <= off < 8 * self.channels and off % 8 == 0:
                return direction, off // 8
        return None

    def register(self, direction: str, channel: int) -> int:
        base = self.s2mm_base if direction == "S2MM" else self.mm2s_base
        return base + 8 * channel + 4

    def decode(self, value: int) -> dict[str, int]:
        return {
            "start_bd_id": value & ((1 << self.bd_id_bits) - 1),
            "repeat_count": (value >> 16) & 0xFF,
            "enable_token_issue": value >> 31,
        }

    def encode(self, bd_id: int, repeat_count: int = 0, token: bool = False) -> int:
        return bd_id | (repeat_count & 0xFF) << 16 | (1 << 31 if token else 0)


QUEUES = {
    SHIM: QueueLayout(SHIM, 0x1D200, 0x1D210, 2, 4),  # NOC_MODULE_DMA_*_TASK_QUEUE
    MEMTILE: QueueLayout(MEMTILE, 0xA0600, 0xA0630, 6, 6),  # MEM_TILE_MODULE_*_START_QUEUE
    CORE: QueueLayout(CORE, 0x1DE00, 0x1DE10, 2, 4),  # MEMORY_MODULE_*_START_QUEUE
}


# -- the access pattern a BD describes ------------------------------------------------------


@dataclass(frozen=True)
class Dim:
    """One address-generator dimension: ``wrap`` elements (0: does not wrap), ``stride``
    words between them."""

    wrap: int
    stride: int


@dataclass(frozen=True)
class Access:
    """The transfer a BD describes, in words: length, base, dimensions (innermost first; the
    last never wraps) and the iteration applied between runs of the BD."""

    length: int
    base: int  # bytes (shim: into the buffer the patch names) / tile-local bytes
    dims: tuple[Dim, ...]
    iteration_wrap: int
    iteration_stride: int
    iteration_current: int

    @property
    def linear(self) -> bool:
        return self.dims[0].wrap == 0 and self.dims[0].stride == 1


def access_of(kind: str, f: dict[str, int]) -> Access:
    """The access pattern of decoded BD fields (see the module docstring for the encodings)."""
    dims: tuple[Dim, ...]
    if kind == SHIM:
        base = (f["base_address_high"] << 32) | (f["base_address_low"] << 2)
        dims = (
            Dim(f["d0_wrap"], f["d0_stepsize"] + 1),
            Dim(f["d1_wrap"], f["d1_stepsize"] + 1),
            Dim(0, f["d2_stepsize"] + 1),
        )
    elif kind == MEMTILE:
        base = f["base_address"] * WORD
        dims = (
            Dim(f["d0_wrap"], f["d0_stepsize"] + 1),
            Dim(f["d1_wrap"], f["d1_stepsize"] + 1),
            Dim(f["d2_wrap"], f["d2_stepsize"] + 1),
            Dim(0, f["d3_stepsize"] + 1),
        )
    else:
        base = f["base_address"] * WORD
        dims = (
            Dim(f["d0_wrap"], f["d0_stepsize"] + 1),
            Dim(f["d1_wrap"], f["d1_stepsize"] + 1),
            Dim(0, f["d2_stepsize"] + 1),
        )
    # a dimension that does not wrap absorbs every count: the ones after it are unused
    for i, d in enumerate(dims):
        if d.wrap == 0:
            dims = dims[: i + 1]
            break
    return Access(
        f["buffer_length"],
        base,
        dims,
        f["iteration_wrap"] + 1,
        f["iteration_stepsize"] + 1,
        f["iteration_current"],
    )


MAX_SPANS = 1 << 16  # contiguous spans enumerated per descriptor; beyond, bounds only


def spans(acc: Access, start: int, runs: int = 1) -> list[tuple[int, int]] | None:
    """Contiguous byte spans (offset, length) the transfer touches, in the order the DMA
    walks them, for ``runs`` runs of the BD (the task queue's repeat count + 1), each run
    moved by the iteration stride; adjacent spans are merged. ``start`` is the byte address
    of element 0 (the patch's offset for a shim BD). None when there would be more than
    ``MAX_SPANS`` spans (use ``bounds``)."""
    n = acc.length
    if n <= 0 or runs <= 0:
        return []
    if acc.linear and (runs == 1 or acc.iteration_wrap == 1):  # the common case, no numpy
        return [(start, WORD * n)] * runs
    d0 = acc.dims[0]
    row = d0.wrap if d0.wrap else n
    contiguous_rows = d0.stride == 1
    nrows = -(-n // row)
    count = (nrows if contiguous_rows else n) * runs
    if count > MAX_SPANS:
        return None
    j = np.arange(nrows, dtype=np.int64)
    offset = np.zeros(nrows, dtype=np.int64)
    rest = j
    for d in acc.dims[1:]:
        idx = rest % d.wrap if d.wrap else rest
        rest = rest // d.wrap if d.wrap else np.zeros_like(rest)
        offset += idx * d.stride
    lengths = np.full(nrows, row, dtype=np.int64)
    lengths[-1] = n - row * (nrows - 1)
    if contiguous_rows:
        starts, lens = offset, lengths
    else:  # every element is its own 4-byte span, d0.stride words apart
        k = np.arange(row, dtype=np.int64) * d0.stride
        starts = (offset[:, None] + k[None, :]).ravel()[:n]
        lens = np.ones(n, dtype=np.int64)
    out: list[tuple[int, int]] = []
    for r in range(runs):
        shift = ((acc.iteration_current + r) % acc.iteration_wrap) * acc.iteration_stride
        s = WORD * (starts + shift)  # relative to ``start``: int64 cannot hold every start
        ln = WORD * lens
        # merge spans that continue the previous one
        brk = np.ones(len(s), dtype=bool)
        brk[1:] = s[1:] != s[:-1] + ln[:-1]
        first = np.flatnonzero(brk)
        ends = np.append(first[1:], len(s))
        csum = np.concatenate([[0], np.cumsum(ln)])
        for a, b in zip(first.tolist(), ends.tolist(), strict=True):
            out.append((start + int(s[a]), int(csum[b] - csum[a])))
    return out


def bounds(acc: Access, start: int, runs: int = 1) -> tuple[int, int]:
    """[lo, hi) that holds every byte the transfer touches (strides are positive; hi is an
    upper bound where the last row is partial)."""
    n = acc.length
    if n <= 0 or runs <= 0:
        return start, start
    last, below = 0, 1
    for i, d in enumerate(acc.dims):
        reach = (n - 1) // below
        if d.wrap and i < len(acc.dims) - 1:
            reach = min(reach, d.wrap - 1)
        last += reach * d.stride
        if not d.wrap:
            break
        below *= d.wrap
    top = acc.iteration_wrap - 1
    if runs < acc.iteration_wrap:
        top = max((acc.iteration_current + r) % acc.iteration_wrap for r in range(runs))
    return start, start + WORD * (last + top * acc.iteration_stride + 1)
