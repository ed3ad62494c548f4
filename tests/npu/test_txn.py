"""TXN decoding on constructed streams: ops, descriptors, patches, regions, ELF, bad input."""

from __future__ import annotations

import struct

import pytest

from moepack.errors import BadInput
from moepack.jsonable import to_jsonable
from moepack.npu import elf, txn, txn_bd

WEIGHTS_ARG = 0  # ref §4: the per-layer weight buffer is kernel argument 0
REGION_A_END = 0x4CB200  # ref §7: region A reads 0x0-0x4cb200 (150 reads)
REGION_B = (0x1BC00000, 0x1CB8E200)  # ref §7: 416 x 18,944 B + 64 x 4,736 B
ROW, BLOCK = 4736, 75_776  # a row; a 16-row block (the stride of 18,944-B = 4-row reads)


def linear_like_stream() -> bytes:
    """A linear layer's weight reads within the bounds reference §7 gives. The reference
    gives the bounds and counts, not each read: here region A is 149 4-KiB reads 32 KiB
    apart plus one ending at 0x4cb200; region B is four runs of 104 4-row reads at 16-row
    strides, then 64 single rows at 16-row strides ending at 0x1cb8e200."""
    ops = [txn.op_write(0x1D214, 1), txn.op_maskwrite(0x1D220, 3, 0xF)]

    def read(offset: int, length: int, arg: int = WEIGHTS_ARG) -> None:
        ops.extend([txn.op_bd(0x1D000, length // 4), txn.op_patch(0x1D004, arg, offset)])

    for i in range(149):
        read(32_768 * i, 4096)
    read(REGION_A_END - 0x1200, 0x1200)
    for q in range(4):
        for blk in range(104):
            read(REGION_B[0] + 4 * ROW * q + BLOCK * blk, 4 * ROW)
    last = REGION_B[1] - ROW - 63 * BLOCK
    for i in range(64):
        read(last + BLOCK * i, ROW)
    ops += [txn.op_bd(0x1D040, 1024), txn.op_patch(0x1D044, 3, 0x1000)]  # another arg
    ops += [txn.op_tct(0x10000, 0x01010000)]
    return txn.build_stream(ops)


def test_decode_ops_descriptors_and_regions():
    data = linear_like_stream()
    (s,) = txn.decode_bytes(data)
    assert s.header["w0"] == 0x06040100 and s.header["dev_gen"] == 4 and s.header["rows"] == 6
    assert s.complete and not s.problems and not s.warnings and s.words == len(data) // 4
    n = 150 + 416 + 64 + 1
    assert s.op_counts() == {"WRITE": 1, "MASKWRITE": 1, "BLOCKWRITE": n, "DDR_PATCH": n, "TCT": 1}
    assert len(s.bds) == n and len(s.patches) == n and s.unpaired == 0
    p = s.patches[0]
    assert p.bd is not None
    assert (p.arg_idx, p.arg_offset, p.bd.length_bytes, p.reg) == (0, 0, 4096, 0x1D004)
    regions = {a.arg_idx: a for a in s.regions()}
    w = regions[WEIGHTS_ARG]
    assert w.patches == 630 and (w.lo, w.hi) == (0, REGION_B[1])
    a_runs = [r for r in w.runs if r.offset < REGION_A_END]
    b_runs = [r for r in w.runs if r.offset >= REGION_B[0]]
    assert len(a_runs) + len(b_runs) == len(w.runs)
    assert sum(r.count for r in a_runs) == 150
    assert min(r.offset for r in a_runs) == 0 and max(r.end for r in a_runs) == REGION_A_END
    assert (
        min(r.offset for r in b_runs) == REGION_B[0] and max(r.end for r in b_runs) == REGION_B[1]
    )
    assert sum(r.count * r.length for r in b_runs) == 416 * 18_944 + 64 * 4736
    assert [(r.length, r.count, r.stride) for r in b_runs] == [(18_944, 104, BLOCK)] * 4 + [
        (4736, 64, BLOCK)
    ]
    assert [(r.offset, r.length) for r in regions[3].runs] == [(0x1000, 4096)]


def test_patch_replaces_descriptor_address_word_and_says_so():
    """The runtime writes buffer address + arg_offset into the patched register, so a
    descriptor's own base-address word is replaced, not added (mlir-aie lowers an offset to
    arg_plus with 0 in the descriptor word): the region starts at arg_offset alone."""
    data = txn.build_stream([txn.op_bd(0x1D040, 1024, 0x40), txn.op_patch(0x1D044, 3, 0x1000)])
    (s,) = txn.decode_bytes(data)
    assert [(r.offset, r.length) for a in s.regions() for r in a.runs] == [(0x1000, 4096)]
    assert len(s.warnings) == 1 and "replaces the base-address word 0x40" in s.warnings[0].text()


def test_argument_outside_the_buffer_objects_is_reported_not_summarised():
    data = txn.build_stream(
        [
            txn.op_bd(0x1D000, 16),
            txn.op_patch(0x1D004, 155_189_248, 0),
            txn.op_bd(0x1D020, 16),
            txn.op_patch(0x1D024, 5, 0x80000100),
            txn.op_bd(0x1D040, 16),
            txn.op_patch(0x1D044, 4, 0x100),
        ]
    )
    (s,) = txn.decode_bytes(data)
    assert [a.arg_idx for a in s.regions()] == [4]
    (w,) = s.warnings
    assert "kernel argument 155,189,248, outside the kernel's 5 buffer objects" in w.message
    assert w.count == 2 and not s.problems


# -- a stream assembled word by word from reference §7 (not from txn's op_* helpers) --------


def _words(ws: list[int]) -> bytes:
    return struct.pack(f"<{len(ws)}I", *ws)


def _reference_ops(maskwrite: list[int]) -> list[list[int]]:
    return [
        [0x00, 0, 0x1D214, 0, 0x11, 0],  # WRITE 0x00, 6 words: reg at 2, value at 4
        # BLOCKWRITE 0x01, 12 words = 4 header + 8 BD words: buffer_length (in 32-bit words)
        # at word 4, buffer_offset at word 5
        [0x01, 0, 0x1D000, 0, 1184, 0x40, 0, 0, 0, 0, 0, 0],
        maskwrite,  # MASKWRITE 0x03
        [0x80, 0, 0x10000, 0x01010000],  # TCT 0x80, 4 words
        # DDR_PATCH 0x81, 12 words: arg_idx at word 8, arg_offset at word 10 (the register
        # it patches at word 6, as in aie-rt; the BD above sits at 0x1D000..0x1D01F)
        [0x81, 0, 0, 0, 0, 0, 0x1D004, 0, 1, 0, 0x1BC00000, 0],
        [0x00, 0, 0x1D218, 0, 0x22, 0],  # WRITE again: decoding stayed in sync
    ]


def _assemble(ops: list[list[int]]) -> bytes:
    body = [w for op in ops for w in op]
    return _words([0x06040100, 0x104, len(ops), 4 * (4 + len(body))] + body)


def test_stream_assembled_from_the_reference_words():
    ops = _reference_ops([0x03, 0, 0x1D220, 0, 3, 0xF, 0])  # MASKWRITE, 7 words
    data = _assemble(ops)
    assert len(data) // 4 == 4 + 6 + 12 + 7 + 4 + 12 + 6
    (s,) = txn.decode_bytes(data)
    assert s.complete and not s.problems
    assert [(o.name, o.words, o.offset) for o in s.ops] == [
        ("WRITE", 6, 16), ("BLOCKWRITE", 12, 40), ("MASKWRITE", 7, 88), ("TCT", 4, 116),
        ("DDR_PATCH", 12, 132), ("WRITE", 6, 180),
    ]  # fmt: skip
    tile = {"column": 0, "row": 0}
    assert s.ops[0].fields == {"reg": 0x1D214, **tile, "local": 0x1D214, "value": 0x11}
    assert s.ops[2].fields == {"reg": 0x1D220, **tile, "local": 0x1D220, "value": 3, "mask": 0xF}
    assert s.ops[5].fields["value"] == 0x22
    (bd,) = s.bds
    assert (bd.length_words, bd.length_bytes, bd.buffer_offset) == (1184, 4736, 0x40)
    (p,) = s.patches
    assert (p.arg_idx, p.arg_offset, p.bd, p.region) == (1, 0x1BC00000, bd, (0x1BC00000, 4736))
    # no Size fields in the reference: every op kind is noted once, with its first offset
    sizeless = [
        w for w in s.warnings if "has no Size field (0); assumed the reference's" in w.message
    ]
    noted = {w.message.split(" at byte")[0]: (w.offset, w.count) for w in sizeless}
    assert noted == {"WRITE": (16, 2), "BLOCKWRITE": (40, 1), "MASKWRITE": (88, 1),
                     "TCT": (116, 1), "DDR_PATCH": (132, 1)}  # fmt: skip
    (other,) = [w for w in s.warnings if w not in sizeless]  # the BD's 0x40 is overwritten
    assert "replaces the base-address word 0x40" in other.message


def test_ops_follow_their_own_size_field_and_disagreements_are_reported():
    """aie-rt's XAie_MaskWrite32Hdr is 32 bytes (8 words), the reference says 7: decoding
    by the reference's count alone would read the 8th word as the next opcode."""
    sized = [
        [0x00, 0, 0x1D214, 0, 0x11, 24],
        [0x01, 0, 0x1D000, 48, 1184, 0x40, 0, 0, 0, 0, 0, 0],
        [0x03, 0, 0x1D220, 0, 3, 0xF, 32, 0],  # 8 words, Size 32 at byte 24
        [0x80, 16, 0x10000, 0x01010000],
        [0x81, 56, 0, 0, 0, 0, 0x1D004, 0, 1, 0, 0x1BC00000, 0, 0, 0],  # 14 words, Size 56
        [0x00, 0, 0x1D218, 0, 0x22, 24],
    ]
    (s,) = txn.decode_bytes(_assemble(sized))
    assert s.complete and not s.problems
    assert [(o.name, o.words) for o in s.ops] == [
        ("WRITE", 6), ("BLOCKWRITE", 12), ("MASKWRITE", 8), ("TCT", 4), ("DDR_PATCH", 14),
        ("WRITE", 6),
    ]  # fmt: skip
    assert s.ops[5].fields["value"] == 0x22 and s.patches[0].region == (0x1BC00000, 4736)
    assert [(w.offset, w.message) for w in s.warnings if "Size" in w.message] == [
        (88, "MASKWRITE at byte 0x58 (word 22): its Size field says 32 B (8 words), the "
             "reference says 7 words; followed the Size field"),
        (136, "DDR_PATCH at byte 0x88 (word 34): its Size field says 56 B (14 words), the "
              "reference says 12 words; followed the Size field"),
    ]  # fmt: skip
    many = txn.build_stream([txn.op_maskwrite_aie_rt(0x1D220 + 4 * i, i, 1) for i in range(5)])
    (s,) = txn.decode_bytes(many)
    assert len(s.ops) == 5 and [o.fields["value"] for o in s.ops] == [0, 1, 2, 3, 4]
    assert len(s.warnings) == 1 and s.warnings[0].count == 5 and s.warnings[0].offset == 16
    assert s.warnings[0].text().endswith("(4 more like it)")


@pytest.mark.parametrize(
    "op, message",
    [
        ([0x00, 0, 1, 0, 2, 20], "WRITE at byte 0x10 (word 4) has Size 20 (impossible"),
        ([0x03, 0, 1, 0, 2, 3, 30], "MASKWRITE at byte 0x10 (word 4) has Size 30 (impossible"),
        ([0x81, 4096, 0, 0], "DDR_PATCH at byte 0x10 (word 4) has Size 4,096 (past the end"),
        ([0x01, 0, 0x1D000, 8], "BLOCKWRITE at byte 0x10 (word 4) has Size 8 (impossible"),
    ],
)
def test_impossible_sizes_stop_the_stream(op, message):
    (s,) = txn.decode_bytes(_assemble([op, [0x80, 16, 0, 0]]))
    assert not s.complete and s.problems[0].offset == 16 and message in s.problems[0].message


def test_patch_pairs_with_the_latest_descriptor_of_its_register():
    ops = [
        txn.op_bd(0x1D000, 100, 0),  # an older descriptor at the same registers
        txn.op_bd(0x1D020, 300, 0),  # another descriptor (other registers), written later
        txn.op_bd(0x1D000, 200, 8),  # the latest at 0x1D000
        txn.op_patch(0x1D004, 1, 0x1000),  # -> the latest 0x1D000 BD, not the last written
        txn.op_bd(0x1D020, 400, 0),
        txn.op_patch(0x1D024, 1, 0x9000),  # -> the 400-word one, not the 300-word one
        txn.op_blockwrite(0x1D040, [50, 0, 0, 0]),  # 4 data words: not a descriptor
        txn.op_blockwrite(0x1D060, [60] + [0] * 15),  # 16 data words: not a descriptor
        txn.op_patch(0x1D044, 2, 0),  # no descriptor covers 0x1D044: unpaired, reported
        txn.op_patch(0x1D064, 2, 0),
    ]
    (s,) = txn.decode_bytes(txn.build_stream(ops))
    assert s.complete and not s.problems and len(s.bds) == 4
    assert [b.length_words for b in s.bds] == [100, 300, 200, 400]
    assert [p.region for p in s.patches] == [(0x1000, 800), (0x9000, 1600), None, None]
    assert s.unpaired == 2 and len(s.warnings) == 2 and s.warnings[1].count == 2
    assert "replaces the base-address word 0x8" in s.warnings[0].message
    w = s.warnings[1]
    assert (
        w.offset == s.patches[2].offset
        and "patches register 0x1d044, which no earlier" in w.message
    )
    assert [a.arg_idx for a in s.regions()] == [1]  # the unpaired ones claim no region


# -- reference §7 sizes -----------------------------------------------------------------------


def _stream_of(words: int, patches: int) -> bytes:
    """A stream of exactly ``words`` words with ``patches`` patch records (each with its
    descriptor), filled with WRITE (6 words) and TCT (4 words) ops."""
    ops = []
    for i in range(patches):
        ops += [txn.op_bd(0x1D000, 1184), txn.op_patch(0x1D004, 0, BLOCK * i)]
    left = words - 4 - 24 * patches
    n_tct = {0: 0, 2: 2, 4: 1}[left % 6] if left % 6 else 0
    n_write = (left - 4 * n_tct) // 6
    assert 6 * n_write + 4 * n_tct == left and n_write >= 0
    ops += [txn.op_write(0x1D214, i) for i in range(n_write)] + [txn.op_tct()] * n_tct
    data = txn.build_stream(ops)
    assert len(data) == 4 * words
    return data


def _elf_of(ctrltext: bytes, total: int) -> bytes:
    """An ELF of exactly ``total`` bytes whose .ctrltext is ``ctrltext``."""
    probe = elf.build_elf({".ctrltext": ctrltext, ".pad": b""})
    blob = elf.build_elf({".ctrltext": ctrltext, ".pad": b"\0" * (total - len(probe))})
    assert len(blob) == total
    return blob


@pytest.mark.parametrize("ref", txn.REFERENCE, ids=lambda r: r.what)
def test_reference_stream_and_elf_sizes(tmp_path, ref):
    assert {(r.what, r.words, r.elf_bytes, r.patches) for r in txn.REFERENCE} == {
        ("linear layer", 24_636, 103_104, 630), ("full-attention layer", 20_566, 86_208, 530),
        ("lm_head", 260, 1_680, None),
    }  # fmt: skip
    patches = ref.patches if ref.patches is not None else 3
    stream = _stream_of(ref.words, patches)
    raw = tmp_path / "layer.txn"
    raw.write_bytes(stream)
    res = txn.decode_file(raw)
    assert not res.problems and res.streams[0].words == ref.words
    got = {(c.reference, c.quantity): (c.expected, c.got, c.ok) for c in res.reference}
    want = {(ref.what, "words"): (ref.words, ref.words, True)}
    if ref.patches is not None:
        want[(ref.what, "patch records")] = (ref.patches, ref.patches, True)
    assert got == want
    path = tmp_path / "layer.elf"
    path.write_bytes(_elf_of(stream, ref.elf_bytes))
    res = txn.decode_file(path)
    assert res.container == "elf:.ctrltext" and res.file_bytes == ref.elf_bytes
    assert all(c.ok and c.identified_by == "ELF size" for c in res.reference)
    assert {c.quantity for c in res.reference} >= {"ELF bytes", "words"}
    if ref.patches is not None:  # one patch record short, same sizes: reported as differing
        short = _stream_of(ref.words, ref.patches - 1)
        path.write_bytes(_elf_of(short, ref.elf_bytes))
        bad = [c for c in txn.decode_file(path).reference if not c.ok]
        assert [(c.quantity, c.expected, c.got) for c in bad] == [
            ("patch records", ref.patches, ref.patches - 1)
        ]
    other = tmp_path / "other.txn"
    other.write_bytes(_stream_of(ref.words + 2, patches))
    assert txn.decode_file(other).reference == []  # no reference size: nothing claimed


def test_elf_ctrltext_and_multiple_streams(tmp_path):
    one = linear_like_stream()
    two = txn.build_stream([txn.op_bd(0x1D000, 65), txn.op_patch(0x1D004, 2, 0)])
    path = tmp_path / "layer.elf"
    path.write_bytes(elf.build_elf({".text": b"\x90" * 24, ".ctrltext": one + two}))
    res = txn.decode_file(path)
    assert res.container == "elf:.ctrltext" and len(res.streams) == 2 and not res.problems
    assert res.streams[1].offset == len(one)
    assert res.streams[1].regions()[0].runs[0].length == 260  # 65 words
    bare = tmp_path / "noctrl.elf"
    bare.write_bytes(elf.build_elf({".text": b"\0" * 8}))
    with pytest.raises(BadInput, match="no '.ctrltext' section"):
        txn.decode_file(bare)


def test_unknown_opcodes():
    good = [txn.op_write(1, 2), txn.op_bd(0x1D000, 8), txn.op_patch(0x1D004, 3, 0x80)]
    custom = struct.pack("<II", 0x9A, 16) + b"\0" * 8  # custom op with a size: skipped
    s = txn.decode_bytes(txn.build_stream(good[:1] + [custom] + good[1:]))[0]
    assert s.complete and len(s.patches) == 1 and s.ops[1].name == "UNKNOWN_0x9a"
    assert "unknown opcode 0x9a at byte 0x28" in s.problems[0].message
    stop = txn.build_stream(good[:2] + [struct.pack("<I", 0x42)] + good[2:])
    s = txn.decode_bytes(stop)[0]
    assert not s.complete and len(s.ops) == 2
    assert s.problems[0].offset == 16 + 24 + 48
    assert "unknown opcode 0x42 at byte 0x58 (word 22)" in s.problems[0].message


def test_header_and_truncation_problems():
    data = txn.build_stream([txn.op_write(1, 2)], num_ops=3)
    s = txn.decode_bytes(data)[0]
    msgs = " | ".join(p.message for p in s.problems)
    assert "header counts 3 operations, decoded 1" in msgs
    cut = txn.build_stream([txn.op_write(1, 2), txn.op_patch(1, 1, 1)])[:-8]
    s = txn.decode_bytes(cut)[0]
    assert not s.complete and "says" in s.problems[0].message
    with pytest.raises(BadInput, match="too short"):
        txn.decode_bytes(b"\0" * 8)


def test_bytes_without_a_txn_header_are_refused_before_decoding():
    """Random bytes (wrong word 0), or a header declaring more ops than its size can hold,
    are not a TXN: refused, not decoded into a table of nonsense."""
    with pytest.raises(BadInput, match="not a TXN stream: header word 0 is 0x01020304, not "
                                       "NPU2's 0x06040100"):  # fmt: skip
        txn.decode_bytes(txn.build_stream([txn.op_write(1, 2)], w0=0x01020304))
    with pytest.raises(BadInput, match=r"declares 2,393,352,214 operations in 40 bytes \(at "
                                       r"most 3 fit\)"):  # fmt: skip
        txn.decode_bytes(txn.build_stream([txn.op_write(1, 2)], num_ops=2_393_352_214))
    # a valid stream followed by garbage: the stream decodes, the rest is named
    data = txn.build_stream([txn.op_write(1, 2)]) + struct.pack("<IIII", 0x06040100, 0, 99, 32)
    (s,) = txn.decode_bytes(data)
    assert s.complete and "16 bytes after the stream are not a TXN" in s.problems[0].message


# -- buffer descriptors field by field ------------------------------------------------------


def _distinct(lay: txn_bd.BdLayout) -> dict[str, int]:
    """A value for every field of a layout, different from its neighbours and within width."""
    return {f.name: (i * 7 + 3) & f.mask for i, f in enumerate(lay.fields)}


def test_bd_layouts_fill_their_words_without_overlap_on_both_devices():
    assert {k: (v.words, v.count, v.base) for k, v in txn_bd.LAYOUTS.items()} == {
        (d, k): w for d in ("npu1", "npu2") for k, w in
        (("shim", (8, 16, 0x1D000)), ("memtile", (8, 48, 0xA0000)), ("core", (6, 16, 0x1D000)))
    }  # fmt: skip
    for lay in txn_bd.LAYOUTS.values():
        for word in range(lay.words):
            used = 0
            for f in (f for f in lay.fields if f.word == word):
                bits = f.mask << f.lsb
                assert bits >> 32 == 0 and not used & bits, (lay.kind, f)
                used |= bits
    shim = txn_bd.SHIM_BD  # spot checks against aie-rt's NOC_MODULE_DMA_BD0_* definitions
    assert (shim.field("d0_wrap"), shim.field("iteration_current"), shim.field("valid_bd")) == (
        txn_bd.Field("d0_wrap", 3, 20, 10),
        txn_bd.Field("iteration_current", 6, 26, 6),
        txn_bd.Field("valid_bd", 7, 25, 1),
    )
    with pytest.raises(ValueError, match="does not fit in 10 bits"):
        shim.encode({"d0_wrap": 1024})


@pytest.mark.parametrize(
    "reg, kind, bd_id",
    [
        (0x1D0A0, "shim", 5),
        (1 << 25 | 1 << 20 | 0xA05E0, "memtile", 47),
        (2 << 20 | 0x1D1E0, "core", 15),
    ],
)
def test_a_bd_block_write_decodes_field_by_field(reg, kind, bd_id):
    lay = txn_bd.layout_for("npu2", txn.tile_address(reg)["row"])
    assert lay.kind == kind
    fields = _distinct(lay)
    (s,) = txn.decode_bytes(txn.build_stream([txn.op_bd_fields(reg, fields)]))
    assert s.complete and not s.problems and s.bd_counts() == {kind: 1}
    (bd,) = s.bds
    assert (bd.kind, bd.bd_id, bd.fields) == (kind, bd_id, fields)
    assert lay.encode(bd.fields) == bd.words  # field by field, and back
    j = to_jsonable(bd)
    assert (
        j["fields"] == fields and j["kind"] == kind and j["length_words"] == fields["buffer_length"]
    )
    acc = bd.access
    assert j["dims"][0] == {"wrap": fields["d0_wrap"], "stride": fields["d0_stepsize"] + 1}
    assert j["iteration"] == {"wrap": fields["iteration_wrap"] + 1,
                              "stride": fields["iteration_stepsize"] + 1,
                              "current": fields["iteration_current"]}  # fmt: skip
    assert acc.length == fields["buffer_length"]


def test_a_block_write_off_the_bd_registers_is_not_a_descriptor():
    fields = {"buffer_length": 64, "valid_bd": 1}
    ops = [
        txn.op_bd_fields(0x1D004, fields),  # starts mid-BD
        txn.op_blockwrite(1 << 25 | 3 << 20 | 0x12340, [0] * 8),  # a core tile's data memory
        txn.op_blockwrite(0x1D200, [0] * 8),  # the DMA channel registers, not a BD
    ]
    (s,) = txn.decode_bytes(txn.build_stream(ops))
    assert s.complete and not s.problems and s.bds == []


def test_queue_writes_give_direction_channel_and_runs():
    f = {"buffer_length": 16, "valid_bd": 1}
    mem = 1 << 25 | 1 << 20
    ops = [
        txn.op_bd_fields(0x1D000, f), txn.op_patch(0x1D004, 0, 0x100),
        txn.op_queue_push(0, 0, "MM2S", 1, 0, repeat_count=2),
        txn.op_bd_fields(0x1D020, f | {"use_next_bd": 1, "next_bd": 3}),
        txn.op_bd_fields(0x1D060, f), txn.op_patch(0x1D024, 1, 0), txn.op_patch(0x1D064, 1, 0x40),
        txn.op_queue_push(0, 0, "S2MM", 0, 1, token=True),
        txn.op_bd_fields(mem | 0xA0000 + 0x20 * 40, f), txn.op_queue_push(1, 1, "MM2S", 5, 40),
        txn.op_queue_push(0, 0, "MM2S", 0, 9),  # a BD this stream does not describe
    ]  # fmt: skip
    (s,) = txn.decode_bytes(txn.build_stream(ops))
    assert s.complete and not s.problems and not s.warnings
    assert [(p.kind, p.direction, p.channel, p.bd_id, p.repeat_count, p.token) for p in s.pushes] == [
        ("shim", "MM2S", 1, 0, 2, False), ("shim", "S2MM", 0, 1, 0, True),
        ("memtile", "MM2S", 5, 40, 0, False), ("shim", "MM2S", 0, 9, 0, False),
    ]  # fmt: skip
    bd0, bd1, bd3, mbd = s.bds
    assert (bd0.direction, bd0.runs, bd1.direction, bd3.direction, mbd.direction) == (
        "MM2S",
        3,
        "S2MM",
        "S2MM",
        "MM2S",
    )  # BD 3 runs after BD 1 on its channel (use_next_bd)
    assert [p.access for p in s.patches] == ["read", "write", "write"]
    assert [(a.arg_idx, a.access, a.patches) for a in s.regions()] == [
        (0, "read", 1),
        (1, "write", 2),
    ]
    read = s.regions()[0]
    assert [(r.offset, r.length, r.count, r.stride) for r in read.runs] == [(0x100, 64, 3, 0)]


ROW_W, BLOCK_W = ROW // 4, BLOCK // 4  # a row and a 16-row block, in 32-bit words


def test_read_regions_come_from_the_decoded_length_and_strides():
    """The seed's walk took one span per descriptor. A BD's bytes are its pattern: region B's
    416 reads of 4 rows at 16-row strides (reference §7) are four strided BDs here — half
    rows (d0, 592 words: a wrap holds 10 bits), 8 of them contiguous (d1), 104 blocks 75,776 B
    apart (d2) — and give the runs 416 linear BDs give."""
    ops = []
    half = ROW_W // 2
    for q in range(4):
        f = {"buffer_length": 4 * ROW_W * 104, "d0_wrap": half, "d1_wrap": 8,
             "d1_stepsize": half - 1, "d2_stepsize": BLOCK_W - 1, "valid_bd": 1}  # fmt: skip
        ops += [txn.op_bd_fields(0x1D000, f), txn.op_patch(0x1D004, 0, REGION_B[0] + 4 * ROW * q)]
    (s,) = txn.decode_bytes(txn.build_stream(ops))
    (w,) = s.regions()
    assert [(r.length, r.count, r.stride) for r in w.runs] == [(18_944, 104, BLOCK)] * 4
    assert w.bytes == 416 * 18_944 and w.lo == REGION_B[0]
    p = s.patches[0]
    assert p.region == (REGION_B[0], 104 * 18_944)  # bytes moved: not one contiguous span
    spans = p.spans()
    assert spans is not None
    assert len(spans) == 104 and spans[1] == (REGION_B[0] + BLOCK, 18_944)
    linear = []
    for q in range(4):
        for blk in range(104):
            linear += [txn.op_bd(0x1D000, 4 * ROW_W),
                       txn.op_patch(0x1D004, 0, REGION_B[0] + 4 * ROW * q + BLOCK * blk)]  # fmt: skip
    (lin,) = txn.decode_bytes(txn.build_stream(linear))
    assert lin.regions()[0].runs == w.runs


def test_iteration_and_element_strides_in_the_spans():
    """Runs of a BD move by the iteration stride, wrapping at the iteration wrap; a d0 stride
    above one word makes every element its own 4-byte span."""
    it = {"buffer_length": 8, "iteration_wrap": 2, "iteration_stepsize": 99, "iteration_current": 1}
    strided = {"buffer_length": 3, "d0_stepsize": 1}  # 3 words, 2 words apart
    ops = [
        txn.op_bd_fields(0x1D000, it), txn.op_patch(0x1D004, 0, 0x1000),
        txn.op_queue_push(0, 0, "MM2S", 0, 0, repeat_count=4),
        txn.op_bd_fields(0x1D020, strided), txn.op_patch(0x1D024, 1, 0x2000),
    ]  # fmt: skip
    (s,) = txn.decode_bytes(txn.build_stream(ops))
    a, b = s.patches
    shifts = [(1 + r) % 3 * 100 * 4 for r in range(5)]  # wrap 3, stride 100 words, from 1
    assert a.spans() == [(0x1000 + sh, 32) for sh in shifts]
    assert b.spans() == [(0x2000, 4), (0x2008, 4), (0x2010, 4)]
    assert a.bd is not None and b.bd is not None
    assert txn_bd.bounds(a.bd.access, 0x1000, 5) == (0x1000, 0x1000 + 800 + 32)
    assert txn_bd.bounds(b.bd.access, 0x2000) == (0x2000, 0x2014)


def test_a_descriptor_with_too_many_spans_is_summarised_by_its_bounds():
    f = {"buffer_length": txn_bd.MAX_SPANS + 1, "d0_stepsize": 1}  # every word its own span
    (s,) = txn.decode_bytes(
        txn.build_stream([txn.op_bd_fields(0x1D000, f), txn.op_patch(0x1D004, 2, 0)])
    )
    assert s.patches[0].spans() is None
    (a,) = s.regions()
    assert (a.bounds_only, a.lo, a.hi) == (1, 0, 4 * 2 * txn_bd.MAX_SPANS + 4)


def test_a_descriptor_changed_after_its_block_write_has_no_static_region():
    """A WRITE to a BD's length word, or an UPDATE_REG adding a scratchpad value to its
    address at run time (mlir-aie's runtime offsets), leaves its region unknown: reported."""
    ops = [
        txn.op_bd(0x1D000, 64), txn.op_patch(0x1D004, 0, 0), txn.op_write(0x1D000, 128),
        txn.op_bd(0x1D020, 64), txn.op_patch(0x1D024, 1, 0), txn.op_create_scratchpad(4),
        txn.op_update_reg(0x1D024, 0, 1),
        txn.op_bd(0x1D040, 64), txn.op_patch(0x1D040, 2, 0),  # the length word, not the address
    ]  # fmt: skip
    (s,) = txn.decode_bytes(txn.build_stream(ops))
    assert s.complete and not s.problems and s.regions() == []
    assert [p.region for p in s.patches] == [None, None, None]
    changed = next(w for w in s.warnings if "was changed after its block write" in w.message)
    assert changed.count == 2 and "WRITE at byte 0x70 (word 0: buffer_length)" in changed.message
    unknown = s.patches[1].unknown_region
    assert unknown is not None
    assert "UPDATE_REG at byte" in unknown
    assert "incr by scratchpad entry 0 at run time" in unknown
    (word0,) = [w for w in s.warnings if "not its address word" in w.message]
    assert "patches word 0 of the shim BD at byte 0x104, not its address word 1" in word0.message


# -- READ_REGS forms, scratchpads, fixed-size ops ----------------------------------------------


def test_read_regs_forms_are_told_apart_by_size_and_recorded():
    regs = [0x04300100, 0x02100004]
    ops = [txn.op_read_regs(regs[:1]), txn.op_read_regs(regs, "u64"), txn.op_read_regs(regs, "u64")]
    (s,) = txn.decode_bytes(txn.build_stream(ops))
    assert s.complete and not s.problems and not s.warnings
    assert [(o.words, o.fields, o.payload) for o in s.ops] == [
        (4, {"count": 1, "address_bits": 32}, regs[:1]),
        (8, {"count": 2, "address_bits": 64}, regs),
        (8, {"count": 2, "address_bits": 64}, regs),
    ]
    assert s.read_regs_forms == {"u32": 1, "u64": 2}
    padded = _words([0x82, 24, 1, 7, 0x100, 0])  # a nonzero padding word: decoded, noted
    (s,) = txn.decode_bytes(_assemble([list(struct.unpack("<6I", padded))]))
    assert s.complete and "padding word before its 64-bit addresses is 0x7" in s.warnings[0].message


@pytest.mark.parametrize(
    "op, message",
    [
        ([0x82, 20, 1, 0, 0x100], "READ_REGS at byte 0x10 (word 4) counts 1 registers in 5 words: "
                                  "its Size fits neither form (4 words with 32-bit addresses, 6 "
                                  "with 64-bit ones)"),
        ([0x82, 24, 9, 0, 0, 0], "counts 9 registers in 6 words"),
        ([0x0A, 4], "CREATE_SCRATCHPAD at byte 0x10 (word 4) is truncated"),
        ([0x0C, 0], "UPDATE_REG at byte 0x10 (word 4) is truncated"),
    ],
)  # fmt: skip
def test_inconsistent_or_truncated_new_ops_stop_the_stream(op, message):
    (s,) = txn.decode_bytes(_words([0x06040100, 0x104, 1, 16 + 4 * len(op)] + op))
    assert not s.complete and s.problems[0].offset == 16 and message in s.problems[0].message


def test_scratchpad_and_update_reg_decode():
    """CREATE_SCRATCHPAD and UPDATE_REG as mlir-aie writes them (TxnEncoding.h, aie-rt's
    XAie_CreateScratchpadHdr / XAie_UpdateRegHdr); the scratchpad is the runtime's buffer."""
    core = 2 << 25 | 3 << 20 | 0x414
    ops = [
        txn.op_update_reg(core, 0),  # before any scratchpad: noted
        txn.op_create_scratchpad(8, scratch_offset=0x1234_5678_9ABC),
        txn.op_update_reg(core, 1, 1, 5), txn.op_update_reg(core, 2, 2),  # entry 2 of 2: past
        txn.op_update_state_table(1, 1, 3), txn.op_noop(), struct.pack("<I", 0x0D),
    ]  # fmt: skip
    (s,) = txn.decode_bytes(txn.build_stream(ops))
    assert s.complete and not s.problems
    assert [(o.name, o.words) for o in s.ops] == [
        ("UPDATE_REG", 3), ("CREATE_SCRATCHPAD", 4), ("UPDATE_REG", 3), ("UPDATE_REG", 3),
        ("UPDATE_STATE_TABLE", 2), ("NOOP", 1), ("UPDATE_SCRATCH", 1),
    ]  # fmt: skip
    assert s.ops[1].fields == {
        "usage_type": 0,
        "size": 8,
        "entries": 2,
        "scratch_offset": 0x1234_5678_9ABC,
    }
    assert s.ops[2].fields == {"state_table_idx": 1, "func": 1, "func_arg": 5, "reg": core,
                               "column": 2, "row": 3, "local": 0x414}  # fmt: skip
    assert s.ops[4].fields == {"state_table_idx": 1, "func": 1, "func_arg": 3}
    (pad,) = s.scratchpads
    assert (pad.entries, pad.readers, pad.entries_read) == (2, 2, [1, 2])
    msgs = [w.message for w in s.warnings]
    assert any("reads state-table entry 0, but no CREATE_SCRATCHPAD precedes it" in m for m in msgs)
    assert any("reads state-table entry 2, past the 2 entries of the scratchpad at byte 0x1c" in m
               for m in msgs)  # fmt: skip
