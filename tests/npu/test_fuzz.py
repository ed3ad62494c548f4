"""Deterministic fuzzing of the three inputs users hand to ``moepack npu``: a ``.q4nx``
header, a pack's manifest and a TXN stream (raw and in an ELF). Every mutation must end in
success or in a ``MoepackError`` (the one-line error family), never in another exception."""

from __future__ import annotations

import copy
import json
import random
import shutil
import struct
from collections.abc import Iterable

import pytest

from moepack.errors import MoepackError
from moepack.npu import elf, txn
from moepack.npu.geometry import check_layers, detect, model_layers
from moepack.npu.packer import layer_plan, pack_layer
from moepack.npu.profiles import all_profiles
from moepack.npu.q4nx import Q4nxFile
from moepack.npu.unpack import unpack

VALUES = [None, True, False, 0, -1, 1, 7, 2**31, 2**32, 2**63, 10**30, -(10**30), 1.5, "",
          "x", "Q9", "I8", "BF16", "linear", "full", "../x", "/etc/passwd", "scaled-1",
          "scaled-0", "scaled-99999999", "layer-03.weights.bin", [], [1], [-1, 4], [2**32, 2**32],
          ["a"], [0, 0], [5120, 0], {}, {"a": 1}]  # fmt: skip


DEEP = "__deeply_nested__"


def _dumps(doc) -> str:
    return json.dumps(doc).replace(json.dumps(DEEP), "[" * 3000 + "0" + "]" * 3000)


def _paths(doc, prefix=()):
    """Every (container, key) path in a JSON document."""
    out: list[tuple[object, object]] = []
    items: Iterable[tuple[object, object]]
    if isinstance(doc, dict):
        items = doc.items()
    elif isinstance(doc, list):
        items = enumerate(doc)
    else:
        return out
    for k, v in items:
        out.append(prefix + (k,))
        out.extend(_paths(v, prefix + (k,)))
    return out


def _mutate(doc, rng: random.Random, paths):
    doc = copy.deepcopy(doc)
    for _ in range(rng.randint(1, 3)):
        path = rng.choice(paths)
        parent = doc
        try:
            for k in path[:-1]:
                parent = parent[k]
            key = path[-1]
            parent[key]  # still there after an earlier mutation?
        except (KeyError, IndexError, TypeError):
            continue
        if not isinstance(parent, (dict, list)):
            continue
        r = rng.random()
        if r < 0.15 and isinstance(parent, dict):
            del parent[key]
        elif r < 0.2:
            parent[key] = [copy.deepcopy(parent[key])]
        elif r < 0.25 and isinstance(parent[key], int) and not isinstance(parent[key], bool):
            parent[key] += rng.choice([-1, 1, 4736, -4096])
        elif r < 0.27:
            parent[key] = DEEP  # becomes 3,000 nested lists in _dumps
        else:
            parent[key] = copy.deepcopy(rng.choice(VALUES))
    return doc


def _raises_only_moepack_errors(fn) -> bool:
    """True if ``fn`` succeeded, False if it raised a MoepackError; anything else fails."""
    try:
        fn()
    except MoepackError as e:
        assert "\n" not in str(e), str(e)
        return False
    return True


def test_fuzz_q4nx_header(tiny_model, tmp_path):
    with open(tiny_model, "rb") as fh:
        (hlen,) = struct.unpack("<Q", fh.read(8))
        raw_header = fh.read(hlen)
        data = fh.read()
    header = json.loads(raw_header)
    paths = _paths(header)
    rng = random.Random(4)
    path = tmp_path / "m.q4nx"
    survived = 0

    def use() -> None:
        with Q4nxFile(path) as m:
            geo = detect(m)
            for prof in all_profiles():
                for layer in model_layers(m):
                    try:
                        roles = {layer: prof.layout(geo, geo.kind(layer)).roles()}
                        check_layers(m, geo, roles)
                    except MoepackError:
                        continue
                    pack_layer(m, layer_plan(m, prof, geo, layer))

    for trial in range(300):
        if trial % 3 == 0:  # bytes of the header itself
            blob = bytearray(raw_header)
            for _ in range(rng.randint(1, 4)):
                blob[rng.randrange(len(blob))] = rng.randrange(256)
            text = bytes(blob)
        else:
            text = _dumps(_mutate(header, rng, paths)).encode()
        hl = len(text) if trial % 10 else rng.choice([0, 1, len(text) + 8, 2**63])
        cut = len(data) if trial % 7 else rng.randrange(len(data))
        path.write_bytes(struct.pack("<Q", hl) + text + data[:cut])
        survived += _raises_only_moepack_errors(use)
    assert 0 < survived < 300


def test_fuzz_manifest(tiny_model, tiny_pack, tmp_path):
    pack = tmp_path / "pack"
    shutil.copytree(tiny_pack, pack)
    doc = json.loads((pack / "manifest.json").read_text())
    used = {"profile", "model", "layers", "layer", "kind", "buffers", "tensors", "name", "file",
            "size", "sha256", "layout_sha256", "role", "dtype", "shape", "nbytes", "retained",
            "geometry", "header_sha256", "format", "version"}  # fmt: skip
    everything = _paths(doc)
    read = [p for p in everything if all(isinstance(k, int) or k in used for k in p)]
    rng = random.Random(5)
    out = tmp_path / "back.q4nx"
    survived = 0
    for trial in range(300):
        mutated = _mutate(doc, rng, read if rng.random() < 0.9 else everything)
        (pack / "manifest.json").write_text(_dumps(mutated))
        check = tiny_model if trial % 4 == 0 else None
        survived += _raises_only_moepack_errors(lambda c=check: unpack(pack, out, check_model=c))
        out.unlink(missing_ok=True)
    assert 0 < survived < 300
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pack"]


def _stream() -> bytes:
    return txn.build_stream([
        txn.op_write(0x1D214, 1), txn.op_maskwrite(0x1D220, 3, 0xF),
        txn.op_maskwrite_aie_rt(0x1D224, 1, 1), txn.op_bd(0x1D000, 1184, 0x40),
        txn.op_patch(0x1D004, 0, 0x1BC00000), txn.op_blockwrite(0x1D040, [1, 2, 3]),
        txn.op_patch(0x1D044, 1, 0), txn.op_tct(0x10000, 0x01010000),
        struct.pack("<II", 0x9A, 16) + b"\0" * 8,
        txn.op_bd_fields(0x1D020, {"buffer_length": 64, "d0_wrap": 4, "d1_wrap": 2,
                                   "d1_stepsize": 7, "iteration_wrap": 1, "valid_bd": 1}),
        txn.op_patch(0x1D024, 2, 0x40), txn.op_queue_push(0, 0, "S2MM", 1, 1, repeat_count=2),
        txn.op_read_regs([0x04300100], "u64"), txn.op_create_scratchpad(8),
        txn.op_update_reg(0x1D024, 1, 1),
    ])  # fmt: skip


@pytest.mark.parametrize("container", ["raw", "elf"])
def test_fuzz_txn(tmp_path, container):
    one = _stream()
    base = one + one
    if container == "elf":
        base = elf.build_elf({".text": b"\x90" * 16, ".ctrltext": base})
    rng = random.Random(6)
    path = tmp_path / "f.bin"
    survived = 0

    def use() -> None:
        res = txn.decode_file(path)
        for s in res.streams:
            s.regions(), s.op_counts(), s.unpaired
        [p.text() for p in res.problems + res.warnings]

    for _ in range(400):
        b = bytearray(base)
        for _ in range(rng.randint(1, 5)):
            r = rng.random()
            if r < 0.5:
                b[rng.randrange(len(b))] = rng.randrange(256)
            elif r < 0.65:
                del b[rng.randrange(len(b)) :]
                if not b:
                    b = bytearray(b"\0")
            else:
                i = rng.randrange(max(1, len(b) - 4)) & ~3
                word = rng.choice([0, 0xFFFFFFFF, 0x7FFFFFFF, 8, 16, 24, 28, 32, 48, 3, 1 << 31])
                b[i : i + 4] = struct.pack("<I", word)
        path.write_bytes(bytes(b))
        survived += _raises_only_moepack_errors(use)
    assert 0 < survived < 400
