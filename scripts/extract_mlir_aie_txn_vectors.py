"""Regenerate tests/npu/data/mlir_aie_txn_vectors.json from snapshots of mlir-aie's tests.

mlir-aie (github.com/Xilinx/mlir-aie, Apache-2.0 WITH LLVM-exception) states the TXN words
its compiler emits in two kinds of lit test, and this script keeps only their facts (numbers,
op names, FileCheck marks; no test text):

- ``aie-translate --aie-npu-to-binary -aie-output-binary=false`` tests check words
  (``// CHECK: 06030100``) beside the ``aiex.npu.*`` operations that produce them: per test
  and FileCheck prefix, the device, the header words, and per operation its name, its
  attributes (numbers, and the tile and address of a buffer it names) and the words checked
  for it, with FileCheck's ``-NEXT`` marks ("binary" vectors);
- ``aie-opt --aie-dma-to-npu`` tests check the lowered operations, among them the buffer
  descriptor words (``memref.global ... = dense<[...]>``, ``{{.*}}`` for a word not checked),
  the BD block write's address, the address patch and the task-queue write32: per module,
  the device, the shim DMA allocations, the ``dma_memcpy_nd`` / ``writebd`` operations with
  their numbers, and the checked lowered operations in order ("lowering" vectors).

    python scripts/extract_mlir_aie_txn_vectors.py SNAPSHOT [SNAPSHOT ...] [--commit SHA]
        [--commits FILE] [--out FILE]

Each SNAPSHOT is a directory holding a part of mlir-aie's ``test/`` tree (same paths); two
versions of one file go in two snapshots. A file's commit comes from the snapshot's own
``commits.json`` ({path: commit}), else from ``--commits``, else ``--commit``; a commit of
``null`` is recorded as not known, with a note.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

LICENCE = "Apache-2.0 WITH LLVM-exception"
HEADER_W0 = {0x06030100, 0x06040100}

RUN = re.compile(r"//\s*RUN:(.*)")
CHECK = re.compile(r"//\s*([A-Z][A-Z0-9_]*)(-NEXT)?:\s*([0-9A-Fa-f]{8})\s*$")
DEVICE = re.compile(r"aie\.device\((\w+)\)\s*(?:@(\w+))?")
SEQUENCE = re.compile(r"runtime_sequence\s*(?:@(\w+))?")
GLOBAL = re.compile(r"memref\.global\s+\"\w+\"\s+constant\s+@(\w+)\s*:.*dense<\[([^\]]*)\]>")
GET_GLOBAL = re.compile(r"(%\w+)\s*=\s*memref\.get_global\s+@(\w+)")
CONSTANT = re.compile(r"(%\w+)\s*=\s*arith\.constant\s+(-?(?:0x[0-9a-fA-F]+|\d+))\s*:\s*(\w+)")
TILE = re.compile(r"(%\w+)\s*=\s*aie\.tile\(\s*(\d+)\s*,\s*(\d+)\s*\)")
OP = re.compile(r"aiex\.npu\.(\w+)\s*(\(([^)]*)\))?\s*(\{(.*)\})?")
ATTR = re.compile(r"(\w+)\s*=\s*(-?(?:0x[0-9a-fA-F]+|\d+))\s*(?::\s*\w+)?")
BOOL_ATTR = re.compile(r"(\w+)\s*=\s*(true|false)\b")
BUFFER = re.compile(r"(%\w+)\s*=\s*aie\.buffer\(\s*(%\w+)\s*\)\s*\{([^}]*)\}")
SYM_NAME = re.compile(r"sym_name\s*=\s*\"(\w+)\"")
BUFFER_REF = re.compile(r"\bbuffer\s*=\s*@(\w+)")
UNKNOWN_COMMIT = "the copy this version was read from names no commit"


def _int(text: str) -> int:
    return int(text, 0)


def _prefixes(runs: list[str]) -> dict[str, bool]:
    """FileCheck prefix -> whether that run folds the DDR aperture offset (the default)."""
    out: dict[str, bool] = {}
    for run in runs:
        if "npu-to-binary" not in run or "FileCheck" not in run:
            continue
        m = re.search(r"--check-prefix[= ](\w+)", run)
        out[m.group(1) if m else "CHECK"] = "--aie-npu-fold-ddr-addr-offset=false" not in run
    return out


def _operands(
    text: str,
    consts: dict[str, int],
    globs: dict[str, list[int]],
    refs: dict[str, str],
    tiles: dict[str, tuple[int, int]],
) -> dict:
    """Attributes an op takes from its operands: block-write data, a patch's offset, a tile."""
    out: dict = {}
    parts = [p.strip() for p in text.split(",") if p.strip()]
    for part in parts:
        name = part.split(":")[0].strip()
        if name in refs:
            out["data"] = globs[refs[name]]
        elif name in consts:
            out["arg_plus"] = consts[name]
        elif name in tiles:
            out["column"], out["row"] = tiles[name]
        elif re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", name):
            out["offset"] = _int(name)
    return out


def _run_option(runs: list[str], name: str) -> str | None:
    """The value of ``--name=value`` on the aie-npu-to-binary RUN line (which device and
    sequence it translates when the file holds several)."""
    for run in runs:
        if "npu-to-binary" in run and (m := re.search(rf"-{name}=(\w+)", run)):
            return m.group(1)
    return None


def _joined(lines: list[str]) -> list[str]:
    """Lines, with an ``aiex.npu`` op whose attribute dictionary spans lines joined into one."""
    out: list[str] = []
    open_op = False
    for line in lines:
        if open_op:
            out[-1] += " " + line.strip()
            open_op = "}" not in line
            continue
        out.append(line)
        open_op = "aiex.npu." in line and "{" in line and "}" not in line
    return out


def _commit_fields(commit: str | None) -> dict:
    return {"commit": commit} if commit else {"commit": None, "commit_note": UNKNOWN_COMMIT}


def _buffer(m: re.Match, tiles: dict[str, tuple[int, int]]) -> tuple[str, dict] | None:
    """(sym_name, {column, row, address}) of an ``aie.buffer`` with an address."""
    name = SYM_NAME.search(m.group(3))
    addr = re.search(r"address\s*=\s*(\d+)", m.group(3))
    if not name or not addr or m.group(2) not in tiles:
        return None
    col, row = tiles[m.group(2)]
    return name.group(1), {
        "name": name.group(1),
        "column": col,
        "row": row,
        "address": int(addr.group(1)),
    }


def extract_file(path: Path, rel: str, commit: str | None) -> list[dict]:
    lines = path.read_text(encoding="utf-8").splitlines()
    runs = [m.group(1) for line in lines if (m := RUN.search(line))]
    prefixes = _prefixes(runs)
    if not prefixes:
        return extract_lowering(lines, runs, rel, commit)
    chosen_device = _run_option(runs, "aie-device-name")
    chosen_sequence = _run_option(runs, "aie-sequence-name")
    device = None
    in_device = in_sequence = True
    consts: dict[str, int] = {}
    globs: dict[str, list[int]] = {}
    refs: dict[str, str] = {}
    tiles: dict[str, tuple[int, int]] = {}
    buffers: dict[str, dict] = {}
    pending: dict[str, list[dict]] = {p: [] for p in prefixes}
    ops: dict[str, list[dict]] = {p: [] for p in prefixes}
    for line in _joined(lines):
        if m := CHECK.search(line):
            if m.group(1) in pending:
                pending[m.group(1)].append(
                    {"word": _int("0x" + m.group(3)), "next": bool(m.group(2))}
                )
            continue
        if line.lstrip().startswith("//"):
            continue
        if m := DEVICE.search(line):
            in_device = chosen_device is None or m.group(2) == chosen_device
            if in_device:
                device = m.group(1)
        if m := SEQUENCE.search(line):
            in_sequence = chosen_sequence is None or m.group(1) == chosen_sequence
        if m := GLOBAL.search(line):
            # a 32-bit global of any signedness is written as its bits (npu_blockwrite_data)
            globs[m.group(1)] = [_int(v.strip()) & 0xFFFFFFFF for v in m.group(2).split(",")]
        if m := GET_GLOBAL.search(line):
            refs[m.group(1)] = m.group(2)
        if m := CONSTANT.search(line):
            consts[m.group(1)] = _int(m.group(2))
        if m := TILE.search(line):
            tiles[m.group(1)] = (int(m.group(2)), int(m.group(3)))
        if (m := BUFFER.search(line)) and (b := _buffer(m, tiles)):
            buffers[b[0]] = b[1]
        if (m := OP.search(line)) and in_device and in_sequence:
            attrs: dict = {k: _int(v) for k, v in ATTR.findall(m.group(5) or "")}
            attrs.update(_operands(m.group(3) or "", consts, globs, refs, tiles))
            if (b := BUFFER_REF.search(m.group(5) or "")) and b.group(1) in buffers:
                attrs["buffer"] = buffers[b.group(1)]
            for p in prefixes:
                ops[p].append({"op": m.group(1), "attrs": attrs, "checks": pending[p]})
                pending[p] = []
    out = []
    for p, fold in prefixes.items():
        seq = ops[p]
        first = seq[0]["checks"] if seq else pending[p]
        header = None
        if len(first) >= 4 and first[0]["word"] in HEADER_W0:
            header = [c["word"] for c in first[:4]]
            del first[:4]
        words = [c["word"] for op in seq for c in op["checks"]] + [c["word"] for c in pending[p]]
        complete = (
            header is not None
            and not pending[p]
            and header[3] == 4 * (4 + len(words))
            and header[2] == len(seq)
            and all(op["checks"] for op in seq)
        )
        out.append(
            {
                "source": rel,
                **_commit_fields(commit),
                "kind": "binary",
                "prefix": p,
                "device": device,
                "fold_ddr_addr_offset": fold,
                "header": header,
                "complete_stream": complete,
                "ops": seq,
            }
        )
    return out


# -- aie-opt --aie-dma-to-npu tests: checked lowered operations --------------------------

LOWER_CHECK = re.compile(r"//\s*CHECK(-SAME|-NEXT|-LABEL)?:\s*(.*)$")
DENSE = re.compile(r"(?:memref<(\d+)xi32>\s*)?=\s*dense<\[(.*)\]>")
ALLOC = re.compile(r"aie\.shim_dma_allocation\s*@(\w+)\s*\(([^)]*)\)")
PACKET = re.compile(r"<([^>]*pkt_\w+\s*=[^>]*)>")
MEMCPY = re.compile(
    r"aiex\.npu\.dma_memcpy_nd\s*\(\s*(%\w+)\s*\[([^\]]*)\]\s*\[([^\]]*)\]\s*\[([^\]]*)\]"
    r"(.*?)\)\s*\{([^}]*)\}\s*:\s*memref<([^>]*)>"
)
WRITEBD = re.compile(r"aiex\.npu\.writebd\s*\{([^}]*)\}")
SEQ_ARGS = re.compile(r"runtime_sequence\s*(?:@\w+)?\s*\(([^)]*)\)")
ELEMENT_BITS = {"i8": 8, "i16": 16, "bf16": 16, "f16": 16, "i32": 32, "f32": 32, "i64": 64}


def _lowered(text: str) -> dict | None:
    """A checked lowered op: BD words (None for a word the test leaves open), a block write's
    address, an address patch, a write32 — literal numbers only."""
    if "memref.global" in text and (m := DENSE.search(text)):
        words = []
        for item in m.group(2).split(","):
            item = item.strip()
            words.append(None if item.startswith("{{") else _int(item) & 0xFFFFFFFF)
        return {"op": "bd_words", "words": words}
    for name in ("blockwrite", "address_patch", "write32"):
        if f"aiex.npu.{name}" in text and (body := re.search(r"\{([^{}]*=[^{}]*)\}", text)):
            attrs = {k: _int(v) for k, v in ATTR.findall(body.group(1))}
            if attrs:
                return {"op": name, "attrs": attrs}
    return None


def _packet(text: str) -> dict:
    m = PACKET.search(text)
    return {k: _int(v) for k, v in ATTR.findall(m.group(1))} if m else {}


def _ints(text: str, consts: dict[str, int]) -> list[int] | None:
    out = []
    for item in text.split(","):
        item = item.strip()
        if re.fullmatch(r"-?\d+", item):
            out.append(int(item))
        elif item in consts:
            out.append(consts[item])
        else:
            return None  # a runtime value: not a static transfer
    return out


def _lowering_module(chunk: list[str]) -> dict | None:
    expected: list[dict] = []
    label = None
    device = None
    tiles: dict[str, tuple[int, int]] = {}
    consts: dict[str, int] = {}
    allocations: dict[str, dict] = {}
    args: list[str] = []
    ops: list[dict] = []
    lines: list[str] = []
    for line in chunk:
        if m := LOWER_CHECK.search(line):
            if m.group(1) == "-LABEL":
                label = m.group(2).strip()
            elif m.group(1) == "-SAME" and lines:
                lines[-1] += " " + m.group(2)
            else:
                lines.append(m.group(2))
    for text in lines:
        if item := _lowered(text):
            expected.append(item)
    for line in _joined([c for c in chunk if not c.lstrip().startswith("//")]):
        if m := DEVICE.search(line):
            device = m.group(1)
        if m := TILE.search(line):
            tiles[m.group(1)] = (int(m.group(2)), int(m.group(3)))
        if m := CONSTANT.search(line):
            consts[m.group(1)] = _int(m.group(2))
        if m := SEQ_ARGS.search(line):
            args = re.findall(r"(%\w+)\s*:", m.group(1))
        if m := ALLOC.search(line):
            parts = [q.strip() for q in re.sub(r"<[^>]*>", "", m.group(2)).split(",") if q.strip()]
            if parts[0].startswith("%") and parts[0] in tiles:  # (%tile, dir, channel, <pkt>)
                col, row = tiles[parts[0]]
                alloc = {"direction": parts[1], "channel": int(parts[2]), "column": col, "row": row}
            else:  # (dir, channel, column)
                alloc = {
                    "direction": parts[0],
                    "channel": int(parts[1]),
                    "column": int(parts[2]),
                    "row": 0,
                }
            if pkt := _packet(m.group(2)):
                alloc["packet"] = pkt
            allocations[m.group(1)] = alloc
        if m := MEMCPY.search(line):
            offsets, sizes, strides = (_ints(m.group(i), consts) for i in (2, 3, 4))
            if offsets is None or sizes is None or strides is None or m.group(1) not in args:
                return None  # runtime sizes: the dynamic path, whose words these tests do not give
            attrs: dict = {k: _int(v) for k, v in ATTR.findall(m.group(6))}
            attrs.update({k: v == "true" for k, v in BOOL_ATTR.findall(m.group(6))})
            meta = re.search(r"metadata\s*=\s*@(\w+)", m.group(6))
            op = {
                "op": "dma_memcpy_nd",
                "arg": args.index(m.group(1)),
                "offsets": offsets,
                "sizes": sizes,
                "strides": strides,
                "element_bits": ELEMENT_BITS.get(m.group(7).split("x")[-1].split(",")[0].strip()),
                "metadata": meta.group(1) if meta else None,
                "attrs": attrs,
            }
            if pkt := _packet(m.group(5)):
                op["packet"] = pkt
            ops.append(op)
        elif m := WRITEBD.search(line):
            ops.append(
                {"op": "writebd", "attrs": {k: _int(v) for k, v in ATTR.findall(m.group(1))}}
            )
    if not expected or not ops:
        return None
    return {
        "label": label,
        "device": device,
        "allocations": allocations,
        "ops": ops,
        "expected": expected,
    }


def extract_lowering(lines: list[str], runs: list[str], rel: str, commit: str | None) -> list[dict]:
    """Vectors of an ``aie-opt --aie-dma-to-npu | FileCheck`` test, one per module that checks
    lowered BD words, block-write addresses, patches or queue writes of static transfers."""
    if not any(
        "aie-dma-to-npu" in r and "FileCheck" in r and "npu-to-binary" not in r for r in runs
    ):
        return []
    chunks: list[list[str]] = [[]]
    for line in lines:
        if line.strip() == "// -----":
            chunks.append([])
        else:
            chunks[-1].append(line)
    out = []
    for i, chunk in enumerate(chunks):
        if mod := _lowering_module(chunk):
            out.append(
                {
                    "source": rel,
                    **_commit_fields(commit),
                    "kind": "lowering",
                    "prefix": "CHECK",
                    "module": i,
                    **mod,
                }
            )
    return out


def _commits_of(snapshot: Path, fallback: dict[str, str | None]) -> dict[str, str | None]:
    own = snapshot / "commits.json"
    return {**fallback, **(json.loads(own.read_text()) if own.exists() else {})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("snapshot", type=Path, nargs="+")
    ap.add_argument("--commit", default="unknown", help="the mlir-aie commit the files are from")
    ap.add_argument(
        "--commits", type=Path, help="JSON {path: commit} where files come from several commits"
    )
    ap.add_argument("--out", type=Path, default=Path("tests/npu/data/mlir_aie_txn_vectors.json"))
    args = ap.parse_args(argv)
    commits = json.loads(args.commits.read_text()) if args.commits else {}
    vectors = []
    several = bool(commits) or len(args.snapshot) > 1
    for snap in args.snapshot:
        known = _commits_of(snap, commits)
        several = several or (snap / "commits.json").exists()
        for path in sorted(snap.glob("test/**/*.mlir")):
            rel = path.relative_to(snap).as_posix()
            vectors += extract_file(path, rel, known.get(rel, args.commit))
    if not vectors:
        print(f"{', '.join(map(str, args.snapshot))}: no tests with word checks", file=sys.stderr)
        return 2
    doc = {
        "what": "TXN words mlir-aie's lit tests expect from aie-translate --aie-npu-to-binary, "
        "with the aiex.npu operations that produce them, and the buffer-descriptor words its "
        "aie-dma-to-npu lowering tests expect, with the transfers that produce them (facts "
        "extracted, no test text)",
        "repository": "https://github.com/Xilinx/mlir-aie",
        "commit": args.commit if not several else "per vector",
        "licence": LICENCE,
        "generator": "scripts/extract_mlir_aie_txn_vectors.py",
        "vectors": vectors,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    ops = sum(len(v["ops"]) for v in vectors)
    print(f"{len(vectors)} vectors, {ops} operations -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
