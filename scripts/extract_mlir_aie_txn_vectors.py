"""Regenerate tests/npu/data/mlir_aie_txn_vectors.json from a snapshot of mlir-aie's tests.

mlir-aie (github.com/Xilinx/mlir-aie, Apache-2.0 WITH LLVM-exception) states, in its lit
tests of ``aie-translate --aie-npu-to-binary -aie-output-binary=false``, the TXN words the
compiler emits (``// CHECK: 06030100``) beside the ``aiex.npu.*`` operations that produce
them. This script reads those tests and keeps only the facts: per test and FileCheck prefix,
the device, the header words, and per operation its name, its attributes (numbers only) and
the words checked for it, with FileCheck's ``-NEXT`` marks. No mlir-aie text is kept.

    python scripts/extract_mlir_aie_txn_vectors.py SNAPSHOT [--commit SHA] [--out FILE]

SNAPSHOT is a directory holding mlir-aie's ``test/`` tree (or a part of it, same paths).
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


def extract_file(path: Path, rel: str, commit: str) -> list[dict]:
    lines = path.read_text(encoding="utf-8").splitlines()
    runs = [m.group(1) for line in lines if (m := RUN.search(line))]
    prefixes = _prefixes(runs)
    if not prefixes:
        return []
    chosen_device = _run_option(runs, "aie-device-name")
    chosen_sequence = _run_option(runs, "aie-sequence-name")
    device = None
    in_device = in_sequence = True
    consts: dict[str, int] = {}
    globs: dict[str, list[int]] = {}
    refs: dict[str, str] = {}
    tiles: dict[str, tuple[int, int]] = {}
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
        if (m := OP.search(line)) and in_device and in_sequence:
            attrs = {k: _int(v) for k, v in ATTR.findall(m.group(5) or "")}
            attrs.update(_operands(m.group(3) or "", consts, globs, refs, tiles))
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
                "commit": commit,
                "prefix": p,
                "device": device,
                "fold_ddr_addr_offset": fold,
                "header": header,
                "complete_stream": complete,
                "ops": seq,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("snapshot", type=Path)
    ap.add_argument("--commit", default="unknown", help="the mlir-aie commit the files are from")
    ap.add_argument(
        "--commits", type=Path, help="JSON {path: commit} where files come from several commits"
    )
    ap.add_argument("--out", type=Path, default=Path("tests/npu/data/mlir_aie_txn_vectors.json"))
    args = ap.parse_args(argv)
    commits = json.loads(args.commits.read_text()) if args.commits else {}
    vectors = []
    for path in sorted(args.snapshot.glob("test/**/*.mlir")):
        rel = path.relative_to(args.snapshot).as_posix()
        vectors += extract_file(path, rel, commits.get(rel, args.commit))
    if not vectors:
        print(f"{args.snapshot}: no aie-npu-to-binary tests with word checks", file=sys.stderr)
        return 2
    doc = {
        "what": "TXN words mlir-aie's lit tests expect from aie-translate --aie-npu-to-binary, "
        "with the aiex.npu operations that produce them (facts extracted, no test text)",
        "repository": "https://github.com/Xilinx/mlir-aie",
        "commit": args.commit if not commits else "per vector",
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
