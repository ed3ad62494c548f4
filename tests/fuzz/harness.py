"""moepack's own fuzz harness: every reader, fed structure-aware and random mutations of valid
inputs through the real CLI, and every path argument of every command, given hostile paths,
must end in exit 0, 1 or 2 with at most one error line on stderr, no traceback, no hang and
no runaway memory.

Used two ways: ``tests/fuzz/test_fuzz_readers.py`` runs a short deterministic pass in a child
process, and ``scripts/fuzz.py --count N --seed S`` a long one. Either way the work happens in
``python tests/fuzz/harness.py``, a child whose address space is capped with
``resource.setrlimit(RLIMIT_AS)`` and whose every CLI run has an alarm, so that an input which
makes a reader allocate or block without bound is reported as a failure instead of taking the
machine or the test session down. The result is one JSON document on stdout.

Two passes. **Paths** (``commands.py``): one valid command line per command, listed against
the CLI's own path parameters (one that no template fills is reported as uncovered); each
path argument in turn gets a FIFO, ``/dev/zero`` (for an output: a device node of our own),
a symlink to it, a symlink to itself, a folder or a plain file, a missing file or parent, a
name with a newline and one the console could take for markup (``[/x]``, under a folder named
``[``); each output also over one of the command's inputs, and into a folder holding what a
killed run or anyone left there (FIFO and ``/dev/zero`` journals, a temporary claiming an
impossible pid, one whose name holds a newline), which must be swept. **Outputs**
(``outputs_pass``): each output named with another kind's extension must be refused with
nothing written; each command run again over its own outputs must be refused, leaving them as
they were, and with ``--force`` replace them. **Mutations**
(``build_targets``: every kind of file a command reads): header counts, lengths and offsets
set to extremes (checksums recomputed where the format has them, so that the mutation reaches
the parser: ``.moetrace`` CRCs, ``.q4nx`` header length, a store index's sha256), declared
expert counts whose squares are gigabytes, a store index that lies about its labels, float32
values of 3e38 in tensor data, JSON values replaced by wrong types, extremes, 5,000-digit
integers and 3,000-deep nesting, text fields replaced by huge numbers, non-UTF-8 bytes and
140,000-character fields, lines dropped and repeated, truncation (anywhere, and by a few
bytes), random bit flips and inserted garbage. **Servers** (``server_pass``): ``fit URL``
against a misbehaving HTTP server on 127.0.0.1 (``tests/rangeserver.py``): each of its
fixed misbehaviours (a Content-Range total of 10^30, a 200 KB header line, 150 headers,
broken chunks, no status line, answers dripped a byte at a time) and answers mutated on the
wire (status codes, Content-Range and Content-Length set to extremes, headers repeated,
chunked, bit flips, truncation, garbage). The file served is a GGUF with no MoE block, so a
run whose answers survive ends right after the header fetch, before llama.cpp.

With ``--requests N``, a third: **requests** (``serverfuzz.py``), ``moepack serve`` on the
seeds' model sent N hostile requests on every route of both its APIs, each answer a 2xx or a
4xx in its route's own shape, within its ``max_tokens``, with nothing of the server's insides,
and the same worker throughout.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import random
import re
import resource
import shutil
import signal
import struct
import sys
import threading
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import commands as C
from seeds import build_seeds

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the range server
import rangeserver  # noqa: E402

Mutator = Callable[[bytes, random.Random], bytes]
RUN_SECONDS = 20  # a reader that takes longer on these small inputs is taken to hang
MEMORY_CAP = 3 << 30  # address space of the harness process (numpy and friends need ~1 GiB)


class Hang(BaseException):
    """Raised by the alarm inside a run that took too long (not an Exception: nothing in
    moepack may catch it)."""


# ---------------------------------------------------------------- generic byte mutations
def flip_bits(data: bytes, rng: random.Random) -> bytes:
    if not data:
        return data
    b = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
    return bytes(b)


def extreme_bytes(data: bytes, rng: random.Random) -> bytes:
    if not data:
        return data
    b = bytearray(data)
    i = rng.randrange(len(b))
    n = rng.choice([1, 2, 4, 8])
    b[i : i + n] = bytes([rng.choice([0x00, 0xFF, 0x7F, 0x80])]) * n
    return bytes(b[: len(data)])


def truncate_anywhere(data: bytes, rng: random.Random) -> bytes:
    return data[: rng.randrange(len(data))] if data else data


def truncate_few(data: bytes, rng: random.Random) -> bytes:
    return data[: max(0, len(data) - rng.randint(1, 16))]


def append_garbage(data: bytes, rng: random.Random) -> bytes:
    return data + rng.randbytes(rng.randint(1, 64))


def insert_garbage(data: bytes, rng: random.Random) -> bytes:
    i = rng.randrange(len(data) + 1)
    return data[:i] + rng.randbytes(rng.randint(1, 16)) + data[i:]


RANDOM: list[tuple[str, Mutator]] = [
    ("flip", flip_bits),
    ("extreme-bytes", extreme_bytes),
    ("truncate", truncate_anywhere),
    ("truncate-few", truncate_few),
    ("append", append_garbage),
    ("insert", insert_garbage),
]

# ---------------------------------------------------------------- integers and JSON
U32_EXTREMES = [0, 1, 2, 7, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF]
U64_EXTREMES = U32_EXTREMES + [1 << 32, 1 << 62, (1 << 63) - 1, (1 << 64) - 1]


def set_field(data: bytes, offset: int, fmt: str, rng: random.Random) -> bytes:
    """The little-endian field at ``offset`` set to an extreme or one bit off its value."""
    size = struct.calcsize(fmt)
    if len(data) < offset + size:
        return data
    (old,) = struct.unpack_from(fmt, data, offset)
    choices = U64_EXTREMES if size == 8 else U32_EXTREMES
    new = rng.choice(choices + [old ^ (1 << rng.randrange(8 * size)), old + 1, max(0, old - 1)])
    return data[:offset] + struct.pack(fmt, new % (1 << (8 * size))) + data[offset + size :]


DEEP = "__moepack_fuzz_deep__"
BIG = "__moepack_fuzz_5000_digits__"
JSON_VALUES: list[object] = [
    None, True, False, 0, -1, 1, 7, 2**31, 2**32, 2**63, 10**30, -(10**30), 1.5, 1e308, "",
    "x", "a\nb", "\u0000", [], [1], [-1, 4], ["a"], [10**30], {}, {"a": 1}, {"device": 1},
    BIG, "[/x]", "[bold]", 8192, 65536,
]  # fmt: skip


def json_dumps(doc: object) -> bytes:
    """JSON text, with every ``DEEP`` marker replaced by 3,000 nested lists and every ``BIG``
    by a 5,000-digit integer (past Python's own int-to-text limit)."""
    text = json.dumps(doc).replace(json.dumps(DEEP), "[" * 3000 + "0" + "]" * 3000)
    return text.replace(json.dumps(BIG), "7" * 5000).encode()


def _paths(doc: object, prefix: tuple = ()) -> list[tuple]:
    items = (
        doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else []
    )
    out: list[tuple] = []
    for k, v in items:
        out.append(prefix + (k,))
        out.extend(_paths(v, prefix + (k,)))
    return out


def mutate_json(doc: object, rng: random.Random) -> object:
    """``doc`` with 1-3 values replaced (wrong types, extremes, deep nesting) or removed."""
    doc = copy.deepcopy(doc)
    paths = _paths(doc)
    top = [p for p in paths if len(p) == 1]  # the fields a reader checks first: favour them
    for _ in range(rng.randint(1, 3)):
        if not paths:
            break
        path = rng.choice(top if top and rng.random() < 0.5 else paths)
        parent = doc
        try:
            for k in path[:-1]:
                parent = parent[k]  # type: ignore[index]
            key = path[-1]
            value = parent[key]  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            continue
        r = rng.random()
        if r < 0.12 and isinstance(parent, dict):
            del parent[key]
        elif r < 0.2:
            parent[key] = DEEP  # type: ignore[index]
        elif r < 0.3 and isinstance(value, int) and not isinstance(value, bool):
            parent[key] = value + rng.choice([-1, 1, 1 << 20, -(1 << 20), 10**30])  # type: ignore[index]
        elif r < 0.35:
            parent[key] = [value]  # type: ignore[index]
        else:
            parent[key] = copy.deepcopy(rng.choice(JSON_VALUES))  # type: ignore[index]
    return doc


def json_mutator(data: bytes, rng: random.Random) -> bytes:
    return json_dumps(mutate_json(json.loads(data), rng))


# ---------------------------------------------------------------- text mutations
TEXT_VALUES = [
    b"99999999999999999999", b"-1", b"1e3", b"x", b"nan", b"\xff", b"\xc3", b"\x00",
    b"5" * 140_000, b"", b"18446744073709551616", b"0x10", b'"', b"\xe2\x80\xa8",
]  # fmt: skip


def mutate_text(data: bytes, rng: random.Random) -> bytes:
    """Line- and field-level edits of a text format (CSV, text trace, pmxplan)."""
    lines = data.split(b"\n")
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(lines))
        r = rng.random()
        if r < 0.55:
            parts = lines[i].replace(b",", b" , ").split(b" ")
            if parts:
                j = rng.randrange(len(parts))
                parts[j] = rng.choice(TEXT_VALUES)
            lines[i] = b" ".join(parts).replace(b" , ", b",")
        elif r < 0.7:
            del lines[i]
            if not lines:
                lines = [b""]
        elif r < 0.8:
            lines.insert(i, lines[i])
        elif r < 0.9:
            j = rng.randrange(len(lines))
            lines[i], lines[j] = lines[j], lines[i]
        else:
            lines[i] = lines[i][: rng.randrange(len(lines[i]) + 1)]
    return b"\n".join(lines)


# ---------------------------------------------------------------- format-aware mutations
def pmxtrace_header(data: bytes, rng: random.Random) -> bytes:
    offset, fmt = rng.choice(
        [(8, "<I"), (12, "<I"), (16, "<I"), (20, "<I"), (24, "<Q"), (32, "<Q")]
    )
    if offset == 16 and rng.random() < 0.5:  # n_expert: counts whose squares are gigabytes
        return data[:16] + struct.pack("<I", rng.choice([8192, 65536, 131072])) + data[20:]
    return set_field(data, offset, fmt, rng)


def _moetrace_parts(data: bytes) -> tuple[dict, bytes]:
    (hlen,) = struct.unpack_from("<I", data, 12)
    return json.loads(data[20 : 20 + hlen]), data[20 + hlen :]


def moetrace_seal(header: bytes, body: bytes) -> bytes:
    """A ``.moetrace`` whose header CRC is right for ``header`` (padded to 64 bytes)."""
    header = header + b" " * ((-(20 + len(header))) % 64)
    fixed = b"MOETRACE" + struct.pack("<II", 1, len(header))
    return fixed + struct.pack("<I", zlib.crc32(header, zlib.crc32(fixed))) + header + body


def moetrace_json(data: bytes, rng: random.Random) -> bytes:
    header, body = _moetrace_parts(data)
    return moetrace_seal(json_dumps(mutate_json(header, rng)), body)


def moetrace_body(data: bytes, rng: random.Random) -> bytes:
    """A body mutation with the body CRC (and the header CRC) recomputed."""
    header, body = _moetrace_parts(data)
    body = rng.choice([flip_bits, extreme_bytes, truncate_few, append_garbage])(body, rng)
    header["body"]["crc32"] = f"{zlib.crc32(body):08x}"
    if rng.random() < 0.5:
        header["body"]["bytes"] = len(body)
    return moetrace_seal(json.dumps(header, sort_keys=True).encode(), body)


def moetrace_counts(data: bytes, rng: random.Random) -> bytes:
    header, body = _moetrace_parts(data)
    key = rng.choice(["shape", "n_expert", "prefill_tokens", "block_map"])
    if key == "shape":
        header["shape"][rng.randrange(3)] = rng.choice(U64_EXTREMES)
    elif key == "block_map" and header["block_map"]:
        header["block_map"][0] = rng.choice(U64_EXTREMES)
    else:
        header[key] = rng.choice(U64_EXTREMES)
    return moetrace_seal(json.dumps(header, sort_keys=True).encode(), body)


def plan_perm(data: bytes, rng: random.Random) -> bytes:
    """A ``.moeplan`` with one permutation entry, block or count set to an extreme."""
    doc = json.loads(data)
    layer = rng.choice(doc["layers"])
    key = rng.choice(["perm", "perm", "block", "n_expert"])
    value = rng.choice([10**30, -(10**30), 2**63, 2**64, -1, len(layer["perm"]), 1.5, "0", None])
    if key == "perm":
        layer["perm"][rng.randrange(len(layer["perm"]))] = value
    else:
        layer[key] = value
    return json.dumps(doc).encode()


def q4nx_json(data: bytes, rng: random.Random) -> bytes:
    (hlen,) = struct.unpack_from("<Q", data, 0)
    header = json_dumps(mutate_json(json.loads(data[8 : 8 + hlen]), rng))
    return struct.pack("<Q", len(header)) + header + data[8 + hlen :]


def q4nx_length(data: bytes, rng: random.Random) -> bytes:
    return set_field(data, 0, "<Q", rng)


def gguf_counts(data: bytes, rng: random.Random) -> bytes:
    return set_field(data, rng.choice([4, 8, 16]), rng.choice(["<I", "<Q"]), rng)


def gguf_metadata(data: bytes, rng: random.Random) -> bytes:
    """Metadata llama.cpp refuses: an ``expert_used_count`` of 0, above the expert count or
    huge (set in place), or an entry of arrays nested 1 to 600 deep (gguf-py parses them by
    recursion) inserted first, its length a multiple of the alignment so every later offset
    moves with it."""
    used = data.find(b".expert_used_count")
    if used > 0 and rng.random() < 0.4:
        at = used + len(b".expert_used_count") + 4  # past the key and its u32 type
        return data[:at] + struct.pack("<I", rng.choice([0, 9, 2**32 - 1])) + data[at + 4 :]
    depth = rng.choice([1, 2, 8, 9, 64, 600])
    value = struct.pack("<IQ", 4, 0)
    for _ in range(depth - 1):
        value = struct.pack("<IQ", 9, 1) + value
    key_len = 1 + (-(8 + 1 + 4 + len(value))) % 32  # the entry: a multiple of 32 bytes
    entry = struct.pack("<Q", key_len) + b"x" * key_len + struct.pack("<I", 9) + value
    (n_kv,) = struct.unpack_from("<Q", data, 16)
    return data[:16] + struct.pack("<Q", n_kv + 1) + entry + data[24:]


def gguf_head_flip(data: bytes, rng: random.Random) -> bytes:
    head = flip_bits(data[:2048], rng)
    return head + data[2048:]


def txn_header(data: bytes, rng: random.Random) -> bytes:
    return set_field(data, rng.choice([0, 4, 8, 12]), "<I", rng)


def txn_ops(data: bytes, rng: random.Random) -> bytes:
    if len(data) <= 16:
        return data
    offset = 16 + 4 * rng.randrange((len(data) - 16) // 4)
    return set_field(data, offset, "<I", rng)


def dump_extend(data: bytes, rng: random.Random) -> bytes:
    return data + bytes(rng.randint(1, 4096))


def gguf_f32_extreme(data: bytes, rng: random.Random) -> bytes:
    """Sixteen float32 values of 3e38 in the tensor data (past the header): float32 sums
    of their squares overflow, as in a compare that reported correlation 1.0."""
    b = bytearray(data)
    lo = min(len(b) - 4, max(4096, len(b) // 4)) & ~3
    for _ in range(16):
        i = rng.randrange(lo, len(b) - 3) & ~3
        b[i : i + 4] = struct.pack("<f", rng.choice([3e38, -3e38]))
    return bytes(b)


def mblt_fields(data: bytes, rng: random.Random) -> bytes:
    """The header's expert count, or one record's layer, k or n_tokens, set to an extreme."""
    words = len(data) // 4
    if rng.random() < 0.3 or words < 6:
        return set_field(data, 8, "<I", rng)
    k = struct.unpack_from("<i", data, 16)[0]
    stride = 3 + max(1, k)
    rec = rng.randrange(max(1, (words - 3) // stride))
    return set_field(data, 12 + 4 * (rec * stride + rng.randrange(3)), "<I", rng)


def _store_parts(data: bytes) -> tuple[bytes, dict, int]:
    from moepack.store.format import HEADER

    fields = HEADER.unpack_from(data)
    i0, ilen = fields[6], fields[7]
    return data[: HEADER.size], json.loads(data[i0 : i0 + ilen]), i0


def store_seal(data: bytes, index: bytes) -> bytes:
    """A store whose header's index length and sha256 are right for ``index``."""
    import hashlib

    from moepack.store.format import HEADER

    magic, version, reserved, align, d0, d1, i0, _ilen, _sha = HEADER.unpack_from(data)
    head = HEADER.pack(magic, version, reserved, align, d0, d1, i0, len(index),
                       hashlib.sha256(index).digest())  # fmt: skip
    return head + data[HEADER.size : i0] + index


def store_index(data: bytes, rng: random.Random) -> bytes:
    _head, doc, _ = _store_parts(data)
    return store_seal(data, json_dumps(mutate_json(doc, rng)))


def store_labels(data: bytes, rng: random.Random) -> bytes:
    """An index that lies (blocks or part kinds swapped, experts renumbered), resealed."""
    _head, doc, _ = _store_parts(data)
    blocks = doc["blocks"]
    r = rng.random()
    if r < 0.4 and len(blocks) > 1:
        blocks[0]["block"], blocks[1]["block"] = blocks[1]["block"], blocks[0]["block"]
    elif r < 0.7:
        parts = rng.choice(blocks)["parts"]
        i, j = rng.sample(range(len(parts)), 2) if len(parts) > 1 else (0, 0)
        parts[i]["kind"], parts[j]["kind"] = parts[j]["kind"], parts[i]["kind"]
    else:
        experts = rng.choice(blocks)["experts"]
        a, b = rng.sample(range(len(experts)), 2)
        experts[a]["expert"], experts[b]["expert"] = experts[b]["expert"], experts[a]["expert"]
    return store_seal(data, json.dumps(doc).encode())


def store_header(data: bytes, rng: random.Random) -> bytes:
    return set_field(data, rng.choice([12, 16, 24, 32, 40, 48]), rng.choice(["<I", "<Q"]), rng)


def jsonl_mutator(data: bytes, rng: random.Random) -> bytes:
    """One line of a JSONL file with its JSON mutated (deep nesting, 5,000-digit integers)."""
    lines = data.split(b"\n")
    full = [i for i, ln in enumerate(lines) if ln.strip()]
    i = rng.choice(full)
    lines[i] = json_dumps(mutate_json(json.loads(lines[i]), rng))
    return b"\n".join(lines)


# ---------------------------------------------------------------- targets
@dataclass(frozen=True)
class Use:
    """A command that reads a target's kind: the slot the mutated file goes in, and inputs
    to put in other slots (a file that is not a model, so llama.cpp is never started)."""

    command: str
    param: str
    others: tuple[tuple[str, str], ...] = ()


@dataclass
class Target:
    """One reader: the seed it mutates, the commands that read it, its mutations."""

    name: str
    seed: str
    uses: list[Use]
    mutators: list[tuple[str, Mutator]] = field(default_factory=list)


NOT_A_MODEL = (("model", "notgguf"),)


def build_targets() -> list[Target]:
    """Every reader moepack has, by the kind of file it reads."""
    json_kinds: list[tuple[str, Mutator]] = [("json", json_mutator), ("text", mutate_text)]
    trace_uses = [Use("trace info", "trace"), Use("trace stats", "trace"),
                  Use("predict", "trace"), Use("trace convert", "src")]  # fmt: skip
    plan_uses = [Use("repack", "plan_path"), Use("verify", "plan_path"),
                 Use("store build", "plan_path"), Use("analyse", "plan_path")]  # fmt: skip
    surface_uses = [Use("surface show", "file"), Use("surface convert", "src"),
                    Use("survey", "surface_path"), Use("advise", "surface_path")]  # fmt: skip
    q4nx_uses = [Use("npu verify", "model"), Use("npu inspect", "model"),
                 Use("npu pack", "model"), Use("npu map", "model")]  # fmt: skip
    gguf_kinds: list[tuple[str, Mutator]] = [
        ("counts", gguf_counts), ("head-flip", gguf_head_flip), ("f32-extreme", gguf_f32_extreme),
        ("metadata", gguf_metadata),
    ]  # fmt: skip
    return [
        Target(
            "gguf", "gguf", [Use("inspect", "model"), Use("compare", "candidate")], gguf_kinds
        ),  # fmt: skip
        Target(
            "repacked",
            "repacked",
            [Use("verify", "repacked"), Use("compare", "candidate")],
            gguf_kinds,
        ),  # fmt: skip
        Target(
            "moetrace",
            "moetrace",
            trace_uses,
            [("header-json", moetrace_json), ("body", moetrace_body), ("counts", moetrace_counts)],
        ),  # fmt: skip
        Target("pmxtrace", "pmxtrace", trace_uses, [("header", pmxtrace_header)]),
        Target("text", "txt", trace_uses, [("text", mutate_text)]),
        Target("routecsv", "csv", trace_uses, [("text", mutate_text)]),
        Target("mblt", "mblt", trace_uses, [("fields", mblt_fields)]),
        Target("moeplan", "moeplan", plan_uses, [*json_kinds, ("perm", plan_perm)]),
        Target("pmxplan", "pmxplan", plan_uses[:2], [("text", mutate_text)]),
        Target("surface", "surface", surface_uses, json_kinds),
        Target("surface-peer", "peer", surface_uses, json_kinds),
        Target(
            "q4nx", "q4nx", q4nx_uses, [("header-json", q4nx_json), ("header-length", q4nx_length)]
        ),  # fmt: skip
        Target(
            "npu-dump",
            "dump",
            [Use("npu verify", "dump")],
            [("extend", dump_extend), ("truncate-few", truncate_few)],
        ),  # fmt: skip
        Target(
            "txn",
            "txn",
            [Use("npu txn decode", "file")],
            [("header", txn_header), ("ops", txn_ops)],
        ),  # fmt: skip
        Target(
            "store",
            "store",
            [Use("store info", "store"), Use("store verify", "store"), Use("replay", "source")],
            [("index", store_index), ("labels", store_labels), ("header", store_header)],
        ),  # fmt: skip
        Target("moeprec", "moeprec", [Use("store build", "precision_path")], json_kinds),
        Target("names", "names", [Use("npu pack", "names")], json_kinds),
        Target(
            "prompts",
            "prompts",
            [
                Use("trace capture", "prompt_file", NOT_A_MODEL),
                Use("run", "prompt_file", NOT_A_MODEL),
            ],
            [("jsonl", jsonl_mutator), ("text", mutate_text)],
        ),  # fmt: skip
        Target(
            "dropin-text",
            "text",
            [Use("check-dropin", "text_file", (("original", "notgguf"), ("candidate", "notgguf")))],
            [("text", mutate_text)],
        ),  # fmt: skip
        Target("config", "config", [Use("survey", "configs")], json_kinds),
        Target("manifest", "pack", [Use("npu unpack", "pack_dir")], json_kinds),
    ]


# ---------------------------------------------------------------- running
def run_cli(
    args: list[str], seconds: int = 20, stop_after: float | None = None
) -> tuple[int | None, str, str, str | None]:
    """``moepack ARGS`` in process through the real entry point: (exit code, stdout, stderr,
    the traceback of an exception that escaped it, or None). ``stop_after``: a server's run,
    sent SIGTERM after that many seconds; its end on that signal (143 and the one
    interrupted line) counts as exit 0 with nothing on stderr."""
    from moepack.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    crash = None
    code: int | None = None
    old = signal.signal(signal.SIGALRM, _alarm)
    # a stop that lands after the command returned must not end the harness
    old_term = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    stop = None
    if stop_after is not None:
        stop = threading.Timer(stop_after, os.kill, (os.getpid(), signal.SIGTERM))
        stop.daemon = True
        stop.start()
    signal.alarm(seconds)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Hang:
        crash = f"no result after {seconds} s (blocked or unbounded)"
    except BaseException:  # noqa: BLE001 - exactly what the harness exists to catch
        crash = traceback.format_exc(limit=-4)
    finally:
        signal.alarm(0)
        if stop is not None:
            stop.cancel()
        signal.signal(signal.SIGALRM, old)
        signal.signal(signal.SIGTERM, old_term)
    text = err.getvalue()
    if stop is not None and code == 128 + signal.SIGTERM:
        lines = text.splitlines()
        if lines and lines[-1].startswith("moepack: interrupted"):
            code, text = 0, "".join(ln + "\n" for ln in lines[:-1])
    return code, out.getvalue(), text, crash


def _alarm(signum: int, frame: object) -> None:
    raise Hang


def verdict(code: int | None, err: str, crash: str | None) -> str | None:
    """Why a run failed the contract, or None when it kept it."""
    if crash is not None:
        return crash.strip().splitlines()[-1] if crash.strip() else "crash"
    if code not in (0, 1, 2):
        return f"exit code {code}"
    if "Traceback" in err:
        return "traceback on stderr"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if not ln.startswith(WARNING_LINES)]
    if len(errors) > 1:
        return f"{len(errors)} stderr lines"
    if code != 0 and (not errors or not errors[0].startswith("moepack: error: ")):
        return "a failure without its one-line error"
    if code == 0 and errors:  # a warning broken over two lines leaves a stray one
        return f"2 stderr lines (a stray line beside the warnings: {errors[0][:60]!r})"
    return None


# One line each, with the prefix every command's warnings and notes carry (``cli.render.say``).
WARNING_LINES = ("moepack: warning: ", "moepack: note: ")


def classify(why: str) -> str:
    """The issue's words for a failure: traceback, hang, memory blowup, multi-line error."""
    if why.startswith("no result after"):
        return "hangs"
    if "MemoryError" in why:
        return "blowups"
    if "stderr lines" in why:
        return "multi_line"
    if why.startswith(("exit code", "a failure without")):
        return "other"
    return "tracebacks"


@dataclass
class Run:
    """State of one harness pass: seeds, the scratch folder, totals and failures."""

    seeds: dict[str, Path]
    scratch: Path
    json_commands: set[str]
    quick: bool = False  # lean command lines: no optional part the run does not test
    failures: list[dict[str, object]] = field(default_factory=list)
    runs: int = 0
    per_target: dict[str, int] = field(default_factory=dict)
    per_path: dict[str, int] = field(default_factory=dict)

    def fresh(self) -> Path:
        """An empty folder for one run's inputs and outputs (each run is like a new process:
        nothing swept or written by an earlier one counts)."""
        from moepack import safeio

        run = self.scratch / "run"
        if run.exists():
            shutil.rmtree(run)
        run.mkdir(parents=True)
        safeio._swept.clear()
        safeio._written.clear()
        return run

    def check(self, args: list[str], seconds: int, what: dict[str, object],
              after: Callable[[int | None], str | None] | None = None) -> None:  # fmt: skip
        server = args[0] in C.SERVERS
        code, _out, err, crash = run_cli(args, seconds, C.SERVE_SECONDS if server else None)
        if not server and crash is not None and crash.startswith("no result after"):
            # a busy machine (CI, other tests) can stall one run: a hang is one twice, the
            # second time with four times as long
            code, _out, err, crash = run_cli(args, 4 * seconds, None)
        self.runs += 1
        broken = C.devices_intact()
        if broken is not None:  # a run damaged the machine: stop, and say which run
            raise SystemExit(f"harness stopped: {broken} after moepack {args}")
        why = verdict(code, err, crash)
        kind = classify(why) if why is not None else "other"
        if why is None and after is not None:
            why = after(code)  # a rule of the command's own broken: not a crash
        if why is not None:
            self.failures.append({**what, "args": args, "exit": code, "why": why,
                                  "kind": kind, "stderr": err[-600:],
                                  "traceback": (crash or "")[-1500:]})  # fmt: skip


def with_json(args: list[str], command: str, run: Run, rng: random.Random) -> list[str]:
    """Half the runs print JSON (the other half render tables), where the command can."""
    return [*args, "--json"] if command in run.json_commands and rng.random() < 0.5 else args


# Commands whose valid runs take seconds (a model in llama.cpp, a probe of the disk, the
# demo's whole pipeline): the quick pass tries only the hostile paths they refuse.
SLOW = C.LLAMA_COMMANDS | {"demo", "probe", "kio", "engines"}
REFUSED = {"fifo", "dev-zero", "zero-link", "loop", "folder", "a-file", "missing", "no-parent"}


def path_pass(run: Run) -> int:
    """Every path argument of every command, each hostile path in its place once; outputs
    also over an input, and into a folder holding what a killed run (or anyone) left."""
    inputs, quick = 0, run.quick

    def lean(slot: C.Slot) -> str | None:
        return slot.param if quick else None

    def ok(code: int | None) -> str | None:
        return None if code == 0 else f"the valid command line failed (exit {code})"

    for command in C.TEMPLATES:  # each valid command line works (the hostile ones are edits)
        for slot in C.slots(command) if quick else C.slots(command)[:1]:
            if quick and command in SLOW:
                continue
            where = run.fresh()
            args = C.argv(command, run.seeds, where, None, lean(slot))
            run.check(args, C.seconds_for(command, RUN_SECONDS),
                      {"target": f"path:{slot.key}", "mutation": "valid", "seed": -1}, ok)  # fmt: skip
            inputs += 1

    for slot in C.all_slots():
        seconds = C.seconds_for(slot.command, RUN_SECONDS)
        slow = slot.command in SLOW
        names = [n for n, _ in C.specials(slot, run.seeds, run.fresh())]
        for name in names:
            if quick and slow and name not in REFUSED:
                continue
            where = run.fresh()
            path = dict(C.specials(slot, run.seeds, where))[name]
            args = C.argv(slot.command, run.seeds, where, {slot.param: str(path)}, lean(slot))
            run.check(args, seconds, {"target": f"path:{slot.key}", "mutation": name, "seed": -1})
            run.per_path[slot.key] = run.per_path.get(slot.key, 0) + 1
            inputs += 1
        if slot.role == "input" or (quick and slow):
            continue
        # an output over one of the command's own inputs (a copy, so no seed is at risk)
        first = next((s for s in C.slots(slot.command) if s.role == "input"), None)
        if first is not None and slot.role == "output" and run.seeds[first.value].is_file():
            where = run.fresh()
            same = where / f"same{run.seeds[first.value].suffix}"
            shutil.copyfile(run.seeds[first.value], same)
            args = C.argv(slot.command, run.seeds, where,
                          {slot.param: str(same), first.param: str(same)}, lean(slot))  # fmt: skip
            run.check(args, seconds, {"target": f"path:{slot.key}", "mutation": "over-input",
                                      "seed": -1})  # fmt: skip
            run.per_path[slot.key] += 1
            inputs += 1
        if slot.command == "demo":  # it refuses a folder it did not make: rightly
            continue
        # hostile leftovers in the output's folder: swept without a hang or a traceback
        where = run.fresh()
        folder = where / slot.value if slot.role == "folder" else where
        folder.mkdir(exist_ok=True)
        planted = C.hostile_leftovers(folder)
        args = C.argv(slot.command, run.seeds, where, None, lean(slot))

        def swept(
            code: int | None, folder: Path = folder, planted: list[str] = planted
        ) -> str | None:
            if code != 0:
                return f"the valid command line failed (exit {code}) beside planted leftovers"
            left = [n for n in planted if os.path.lexists(folder / n)]
            return f"the sweep left {left}" if left else None

        run.check(args, seconds, {"target": f"path:{slot.key}", "mutation": "leftovers",
                                  "seed": -1}, swept)  # fmt: skip
        run.per_path[slot.key] += 1
        inputs += 1
    return inputs


def wrong_kind(slot: C.Slot) -> str:
    """An extension that names another kind of moepack file than ``slot`` writes."""
    from moepack.filekinds import kind_of

    return ".gguf" if kind_of(slot.value) == kind_of("x.moeplan") else ".moeplan"


def outputs_pass(run: Run) -> int:
    """The rules every output keeps: a name with another moepack kind's extension is refused
    with nothing written; a command run again over its own outputs is refused (exit 2, the
    files as they were) and with ``--force`` replaces them (the demo's folder is its own)."""
    inputs, quick = 0, run.quick
    for slot in C.all_slots():
        if slot.role != "output":
            continue
        where = run.fresh()
        path = where / f"wrong{wrong_kind(slot)}"
        args = C.argv(slot.command, run.seeds, where, {slot.param: str(path)},
                      slot.param if quick else None)  # fmt: skip

        def refused(code: int | None, path: Path = path) -> str | None:
            if code != 2:
                return f"an output named {path.name!r} was not refused (exit {code})"
            return f"{path.name} was written" if os.path.lexists(path) else None

        run.check(args, C.seconds_for(slot.command, RUN_SECONDS),
                  {"target": f"path:{slot.key}", "mutation": "wrong-kind", "seed": -1},
                  refused)  # fmt: skip
        run.per_path[slot.key] = run.per_path.get(slot.key, 0) + 1
        inputs += 1
    for command in C.TEMPLATES:
        written = [s for s in C.slots(command) if s.role == "output" or C.is_output_folder(s)]
        if not written or (quick and command in SLOW):
            continue
        seconds = C.seconds_for(command, RUN_SECONDS)
        where = run.fresh()
        args = C.argv(command, run.seeds, where)
        what = {"target": f"path:{written[0].key}", "seed": -1}
        failures = len(run.failures)
        run.check(args, seconds, {**what, "mutation": "again-first"},
                  lambda c: None if c == 0 else f"the valid command line failed (exit {c})")  # fmt: skip
        inputs += 1
        before = C.snapshot(where)
        if len(run.failures) > failures:
            continue
        if command in C.SERVERS and not before:  # stopped before any request: nothing traced
            continue
        from moepack import safeio

        safeio._swept.clear()
        own = command == "demo"  # its folder is its own: every run replaces its files

        def kept(code: int | None, before: dict[str, bytes] = before, where: Path = where,
                 own: bool = own) -> str | None:  # fmt: skip
            if own:
                return None if code == 0 else f"the demo's second run failed (exit {code})"
            if code != 2:
                return f"a second run over existing outputs was not refused (exit {code})"
            return None if C.snapshot(where) == before else "a refused run changed the outputs"

        run.check(args, seconds, {**what, "mutation": "again"}, kept)
        inputs += 1
        if own:  # nothing to force
            continue
        safeio._swept.clear()
        run.check([*args, "--force"], seconds, {**what, "mutation": "again-force"},
                  lambda c: None if c == 0 else f"--force over existing outputs failed (exit {c})")  # fmt: skip
        inputs += 1
    return inputs


def mutation_pass(run: Run, targets: list[Target], count: int, seed: int) -> int:
    rng = random.Random(seed)
    for t in targets:
        run.per_target.setdefault(t.name, 0)
    for i in range(count):
        case_seed = rng.randrange(1 << 32)
        case_rng = random.Random(case_seed)
        target = targets[i % len(targets)]  # every reader gets the same share
        use = case_rng.choice(target.uses)
        # structure-aware mutations reach the parsers' checks: three turns to each random one
        how, mutate = case_rng.choice(target.mutators * 3 + RANDOM)
        where = run.fresh()
        seed_path = run.seeds[target.seed]
        if seed_path.is_dir():  # a pack folder: its manifest is what is mutated
            path = where / seed_path.name
            shutil.copytree(seed_path, path)
            member = path / "manifest.json"
        else:
            path = member = where / f"input{seed_path.suffix}"
            shutil.copyfile(seed_path, member)
        data = member.read_bytes()
        try:
            mutated = mutate(data, case_rng)
        except (ValueError, KeyError, IndexError, TypeError, struct.error):
            mutated = flip_bits(data, case_rng)  # the seed's structure did not allow it
        member.write_bytes(mutated)
        override = {use.param: str(path)}
        override.update({p: str(run.seeds[k]) for p, k in use.others})
        lean = use.param if run.quick else None
        args = with_json(C.argv(use.command, run.seeds, where, override, lean), use.command,
                         run, case_rng)  # fmt: skip
        seconds = RUN_SECONDS  # the llama.cpp commands' readers refuse before it starts
        run.check(args, seconds, {"target": target.name, "mutation": how, "seed": case_seed})
        run.per_target[target.name] += 1
    return count


# ---------------------------------------------------------------- misbehaving servers
SERVER_TIMEOUT = 1  # fit --timeout: a dripping server is cut after this many seconds


def _split_answer(answer: bytes) -> tuple[list[bytes], bytes]:
    head, _sep, body = answer.partition(b"\r\n\r\n")
    return head.split(b"\r\n"), body


def _join_answer(lines: list[bytes], body: bytes) -> bytes:
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def answer_status(answer: bytes, rng: random.Random) -> bytes:
    lines, body = _split_answer(answer)
    code = rng.choice([b"100", b"200", b"204", b"206", b"301", b"302", b"416", b"500", b"999",
                       b"-1", b"2060", b"x"])  # fmt: skip
    lines[0] = rng.choice([b"HTTP/1.1 ", b"HTTP/1.0 ", b"HTTP/9 ", b""]) + code + b" Why"
    return _join_answer(lines, body)


def answer_numbers(answer: bytes, rng: random.Random) -> bytes:
    """Content-Range or Content-Length with a number set to an extreme or garbage."""
    lines, body = _split_answer(answer)
    values = [str(v).encode() for v in U64_EXTREMES + [10**30, -1, 2**64]] + [b"", b"x", b"1e3"]
    for i, line in enumerate(lines):
        if line.startswith(b"Content-Range") and rng.random() < 0.6:
            nums = re.findall(rb"\d+", line)
            if nums:
                j = rng.randrange(len(nums))
                parts = re.split(rb"(\d+)", line)
                k = [n for n, p in enumerate(parts) if p.isdigit()][j]
                parts[k] = rng.choice(values)
                lines[i] = b"".join(parts)
        elif line.startswith(b"Content-Length") and rng.random() < 0.5:
            lines[i] = b"Content-Length: " + rng.choice(values)
    return _join_answer(lines, body)


def answer_headers(answer: bytes, rng: random.Random) -> bytes:
    """Headers repeated, dropped, made huge, or the body sent chunked (well or badly)."""
    lines, body = _split_answer(answer)
    r = rng.random()
    if r < 0.25 and len(lines) > 1:
        lines = lines[:1] + [rng.choice(lines[1:])] * rng.choice([2, 99, 101, 500]) + lines[1:]
    elif r < 0.45 and len(lines) > 1:
        del lines[rng.randrange(1, len(lines))]
    elif r < 0.6:
        lines.insert(1, b"X-Big: " + b"a" * rng.choice([1000, 65_536, 70_000]))
    else:
        lines = [ln for ln in lines if not ln.startswith(b"Content-Length")]
        lines.append(b"Transfer-Encoding: chunked")
        size = rng.choice([b"%x" % len(body), b"%x" % (len(body) + 7), b"zz", b"-1", b"f" * 40])
        body = size + b"\r\n" + body + b"\r\n" + rng.choice([b"0\r\n\r\n", b"", b"1\r\n"])
    return _join_answer(lines, body)


HTTP_MUTATORS: list[tuple[str, Mutator]] = [
    ("status", answer_status), ("numbers", answer_numbers), ("headers", answer_headers),
] * 3 + RANDOM  # fmt: skip


def dense_gguf(path: Path) -> Path:
    """A small GGUF with no MoE block: ``fit`` refuses it right after reading its header."""
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(path, "llama")
    w.add_block_count(1)
    for name in ("blk.0.ffn_up.weight", "blk.0.ffn_down.weight", "token_embd.weight"):
        w.add_tensor(name, np.ones((16, 16), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _on_the_wire(mutate: Mutator, rng: random.Random) -> Callable[[bytes], bytes]:
    def answer(raw: bytes) -> bytes:
        return mutate(raw, rng)

    return answer


def server_pass(run: Run, count: int, seed: int) -> int:
    """``fit URL`` against ``count`` misbehaving servers: every fixed misbehaviour of the
    range server once, then answers mutated on the wire; each must be one line, exit 2."""
    rng = random.Random(seed ^ 0x5E4E)
    folder = run.scratch / "served"
    folder.mkdir(parents=True, exist_ok=True)
    dense_gguf(folder / "m.gguf")
    fixed = sorted(rangeserver.MISBEHAVIOURS) + ["hang", "norange", "short", "redirect"]
    run.per_target["http-server"] = 0
    for i in range(count):
        case_seed = rng.randrange(1 << 32)
        case_rng = random.Random(case_seed)
        if i < len(fixed):
            mode, how = fixed[i], fixed[i]
            mutate: Mutator | None = None
        else:
            mode = "mutate"
            how, mutate = case_rng.choice(HTTP_MUTATORS)
        with rangeserver.serving(folder, mode) as srv:
            if mutate is not None:
                srv.mutate = _on_the_wire(mutate, case_rng)
            args = ["fit", f"{srv.url}/m.gguf", "--timeout", str(SERVER_TIMEOUT), "-q"]
            args = with_json(args, "fit", run, case_rng)

            def refused(code: int | None) -> str | None:
                return None if code == 2 else f"a misbehaving server was not refused (exit {code})"

            run.fresh()
            run.check(args, RUN_SECONDS, {"target": "http-server", "mutation": how,
                                          "seed": case_seed}, refused)  # fmt: skip
        run.per_target["http-server"] += 1
    return count


def fuzz(
    folder: Path, count: int, seed: int, paths: str = "all", requests: int = 0
) -> dict[str, object]:
    """``count`` mutated inputs spread over every reader, (``paths``: "all", "quick" or
    "none") every path argument of every command with each hostile path, and ``requests``
    hostile requests to a served model (``serverfuzz``); returns totals and the failures
    (each with the seed that reproduces it)."""
    import click

    from moepack.cli.main import cli

    folder.mkdir(parents=True, exist_ok=True)
    seeds = build_seeds(folder / "seeds")
    targets = build_targets()
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))
    ctx = click.Context(cli)
    json_commands = set()
    for command in C.TEMPLATES:
        node: click.Command | None = cli
        for word in command.split():
            assert isinstance(node, click.Group)
            node = node.get_command(ctx, word)
        if node is not None and any(p.name == "as_json" for p in node.params):
            json_commands.add(command)
    run = Run(seeds, folder / "scratch", json_commands, quick=paths == "quick")
    t0 = time.perf_counter()
    inputs = path_pass(run) + outputs_pass(run) if paths != "none" else 0
    inputs += mutation_pass(run, targets, count, seed)
    inputs += server_pass(run, max(len(rangeserver.MISBEHAVIOURS) + 4, count // len(targets)), seed)
    served: dict[str, object] = {}
    if requests:
        from serverfuzz import request_pass

        served = request_pass(
            seeds["gguf"], sys.executable, requests, seed,
            lambda doc, rng: json_dumps(mutate_json(doc, rng)),
        )  # fmt: skip
        run.failures.extend(served.pop("failures"))  # type: ignore[arg-type]
        inputs += requests
    kinds = {k: 0 for k in ("tracebacks", "hangs", "blowups", "multi_line", "server", "other")}
    for f in run.failures:
        kinds[str(f["kind"])] += 1
    return {
        "seed": seed,
        "inputs": inputs,
        "runs": run.runs,
        "failures": run.failures,
        "kinds": kinds,
        "per_target": run.per_target,
        "per_path": run.per_path,
        "path_parameters": len(C.path_parameters()),
        "uncovered": C.uncovered(),
        "served": served,
        "seconds": round(time.perf_counter() - t0, 1),
        "memory_cap_bytes": MEMORY_CAP,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=200, help="mutated inputs to run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", type=Path, required=True, help="scratch folder")
    ap.add_argument(
        "--paths",
        choices=["all", "quick", "none"],
        default="all",
        help="hostile paths in every path argument (quick: not the slow runs)",
    )
    ap.add_argument("--requests", type=int, default=0,
                    help="hostile requests to a served model (serverfuzz.py)")  # fmt: skip
    ns = ap.parse_args(argv)
    os.environ["COLUMNS"] = "80"  # a terminal's width: a line wrapped there is two lines
    result = fuzz(ns.dir, ns.count, ns.seed, ns.paths, ns.requests)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
