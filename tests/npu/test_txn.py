"""TXN decoding on constructed streams: ops, descriptors, patches, regions, ELF, bad input."""

from __future__ import annotations

import struct

import pytest

from moepack.errors import BadInput
from moepack.npu import elf, txn


def linear_like_stream() -> bytes:
    """Region B reads as reference §7 describes: 416 x 18,944 B + 64 x 4,736 B at 75,776-B
    strides, plus some other traffic on another argument."""
    ops = [txn.op_write(0x1D214, 1), txn.op_maskwrite(0x1D220, 3, 0xF)]
    for i in range(416):
        ops += [txn.op_bd(0x1D000, 18_944 // 4), txn.op_patch(0x1D004, 1, 0x1BC00000 + 75_776 * i)]
    for i in range(64):
        ops += [txn.op_bd(0x1D020, 4736 // 4, 0), txn.op_patch(0x1D024, 1, 0x1CB00000 + 75_776 * i)]
    ops += [txn.op_bd(0x1D040, 1024, 0x40), txn.op_patch(0x1D044, 0, 0x1000)]
    ops += [txn.op_tct(0x10000, 0x01010000)]
    return txn.build_stream(ops)


def test_decode_ops_descriptors_and_regions():
    data = linear_like_stream()
    (s,) = txn.decode_bytes(data)
    assert s.header["w0"] == 0x06040100 and s.header["dev_gen"] == 4 and s.header["rows"] == 6
    assert s.complete and not s.problems and s.words == len(data) // 4
    assert s.op_counts() == {
        "WRITE": 1,
        "MASKWRITE": 1,
        "BLOCKWRITE": 481,
        "DDR_PATCH": 481,
        "TCT": 1,
    }
    assert len(s.bds) == 481 and len(s.patches) == 481
    p = s.patches[0]
    assert (p.arg_idx, p.arg_offset, p.bd.length_bytes, p.reg) == (1, 0x1BC00000, 18_944, 0x1D004)
    regions = {a.arg_idx: a for a in s.regions()}
    runs = [(r.offset, r.length, r.count, r.stride) for r in regions[1].runs]
    assert runs == [(0x1BC00000, 18_944, 416, 75_776), (0x1CB00000, 4736, 64, 75_776)]
    assert regions[1].bytes == 416 * 18_944 + 64 * 4736
    assert [(r.offset, r.length) for r in regions[0].runs] == [
        (0x1040, 4096)
    ]  # arg offset + BD offset


def test_elf_ctrltext_and_multiple_streams(tmp_path):
    one = linear_like_stream()
    two = txn.build_stream([txn.op_bd(0x1D000, 65), txn.op_patch(0x1D004, 2, 0)])
    path = tmp_path / "layer.elf"
    path.write_bytes(elf.build_elf({".text": b"\x90" * 24, ".ctrltext": one + two}))
    res = txn.decode_file(path)
    assert res.container == "elf:.ctrltext" and len(res.streams) == 2 and not res.problems
    assert res.streams[1].offset == len(one)
    assert res.streams[1].regions()[0].runs[0].length == 260
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
    data = txn.build_stream([txn.op_write(1, 2)], w0=0x01020304, num_ops=5)
    s = txn.decode_bytes(data)[0]
    msgs = " | ".join(p.message for p in s.problems)
    assert "not NPU2's 0x06040100" in msgs and "header counts 5 operations, decoded 1" in msgs
    cut = txn.build_stream([txn.op_write(1, 2), txn.op_patch(1, 1, 1)])[:-8]
    s = txn.decode_bytes(cut)[0]
    assert not s.complete and "says" in s.problems[0].message
    with pytest.raises(BadInput, match="too short"):
        txn.decode_bytes(b"\0" * 8)
