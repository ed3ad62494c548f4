"""moepack's own fuzz harness: every reader, fed structure-aware and random mutations of valid
inputs through the real CLI, must end in exit 0, 1 or 2 with at most one error line on stderr,
no traceback, no hang and no runaway memory.

Used two ways: ``tests/fuzz/test_fuzz_readers.py`` runs a short deterministic pass in a child
process, and ``scripts/fuzz.py --count N --seed S`` a long one. Either way the work happens in
``python tests/fuzz/harness.py``, a child whose address space is capped with
``resource.setrlimit(RLIMIT_AS)`` and whose every CLI run has an alarm, so that an input which
makes a reader allocate or block without bound is reported as a failure instead of taking the
machine or the test session down. The result is one JSON document on stdout.

Mutations per input kind: header counts, lengths and offsets set to extremes (with checksums
recomputed where the format has them, so that the mutation reaches the parser), JSON values
replaced by wrong types, extremes and 3,000-deep nesting, text fields replaced by huge
numbers, non-UTF-8 bytes and 140,000-character fields, lines dropped and repeated, truncation
(anywhere, and by a few bytes), random bit flips, and paths that are not regular files (a
folder, a FIFO, ``/dev/zero``, a missing file).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import random
import resource
import signal
import struct
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

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


JSON_VALUES: list[object] = [
    None, True, False, 0, -1, 1, 7, 2**31, 2**32, 2**63, 10**30, -(10**30), 1.5, 1e308, "",
    "x", "a\nb", "\u0000", [], [1], [-1, 4], ["a"], [10**30], {}, {"a": 1}, {"device": 1},
]  # fmt: skip
DEEP = "__moepack_fuzz_deep__"


def json_dumps(doc: object) -> bytes:
    """JSON text, with every ``DEEP`` marker replaced by 3,000 nested lists."""
    return json.dumps(doc).replace(json.dumps(DEEP), "[" * 3000 + "0" + "]" * 3000).encode()


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


# ---------------------------------------------------------------- targets
@dataclass
class Target:
    """One reader: a valid input, the CLI arguments that read it, its mutations."""

    name: str
    seed: Path
    args: Callable[[Path, Path, random.Random], list[str]]
    mutators: list[tuple[str, Mutator]] = field(default_factory=list)


def build_targets(folder: Path) -> list[Target]:
    """Write one valid input of every kind into ``folder`` and describe how to read it."""
    import numpy as np

    from moepack.checkpoint import MoeModel
    from moepack.checkpoint.synth import synth_model
    from moepack.layout.coactivation_plan import plan_from_trace
    from moepack.layout.plan import save_plan
    from moepack.npu.geometry import Geometry, detect
    from moepack.npu.packer import layer_plan, pack_buffer
    from moepack.npu.profiles import get_profile
    from moepack.npu.q4nx import Q4nxFile, TensorSpec, write_q4nx
    from moepack.npu.synth import produce
    from moepack.npu.txn import build_stream, op_bd, op_patch, op_write
    from moepack.storage.surface import PEER_FORMAT, Surface, SurfaceCell
    from moepack.trace import save_trace, synth_trace

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from moefixtures import tiny_spec

    folder.mkdir(parents=True, exist_ok=True)
    model = synth_model(folder / "m.gguf", tiny_spec()).paths[0]
    with MoeModel(model) as m:
        trace = synth_trace(m, tokens=64, seed=1)
        plan = plan_from_trace(m, trace).plan
    for ext in ("moetrace", "pmxtrace", "txt", "csv"):
        save_trace(trace, folder / f"t.{ext}")
    save_plan(plan, folder / "p.moeplan")
    save_plan(plan, folder / "p.pmxplan")
    cells = [SurfaceCell(s, q, 1e8 * q + s) for s in (4096, 65536, 1 << 20) for q in (1, 4, 16)]
    surface = Surface(cells, engine="pread", mode="direct", device={"source": "/dev/x"})
    surface.save(folder / "s.json")
    surface.save(folder / "peer.json", PEER_FORMAT)

    geo = Geometry.scaled(1)
    profile, layer = "seed-2026-09", 3
    roles = get_profile(profile).layout(geo, geo.kind(layer)).roles()
    q4nx = folder / "tiny.q4nx"
    specs = [
        TensorSpec(geo.name_of(r, layer), geo.shape(r).dtype, geo.shape(r).shape) for r in roles
    ]
    with open(q4nx, "wb") as fh:
        write_q4nx(fh, specs, lambda s: produce(s, 1), {"moepack.geometry": geo.name})
    with Q4nxFile(q4nx) as qm:
        buf = pack_buffer(
            qm, layer_plan(qm, get_profile(profile), detect(qm), layer).buffer("weights")
        )
    dump = folder / "dump.bin"
    np.asarray(buf).tofile(dump)
    stream = build_stream([op_write(0x1000, 7), op_bd(0x2000, 16, 64), op_patch(0x2004, 1, 64)])
    (folder / "x.txn").write_bytes(stream)

    def trace_info(extra: list[str]) -> Callable[[Path, Path, random.Random], list[str]]:
        def args(x: Path, scratch: Path, rng: random.Random) -> list[str]:
            with_model = ["--model", str(model)] if rng.random() < 0.5 else []
            return ["trace", "info", str(x), *extra, *with_model, "--json"]

        return args

    def repack(x: Path, scratch: Path, rng: random.Random) -> list[str]:
        return ["repack", str(model), "--plan", str(x), "--out", str(scratch / "o.gguf"), "-q"]

    def surface_show(x: Path, scratch: Path, rng: random.Random) -> list[str]:
        return ["surface", "show", str(x), "--at", "64K@4", "--json"]

    def npu_verify(dump_path: Path, model_path: Path) -> list[str]:
        return ["npu", "verify", "--dump", str(dump_path), "--model", str(model_path),
                "--layer", str(layer), "--profile", "auto", "--locate", "2", "--mismatches", "2",
                "-q"]  # fmt: skip

    json_kinds: list[tuple[str, Mutator]] = [("json", json_mutator), ("text", mutate_text)]
    return [
        Target(
            "gguf",
            model,
            lambda x, s, r: ["inspect", str(x), "--json"],
            [("counts", gguf_counts), ("head-flip", gguf_head_flip)],
        ),  # fmt: skip
        Target(
            "moetrace",
            folder / "t.moetrace",
            trace_info([]),
            [("header-json", moetrace_json), ("body", moetrace_body), ("counts", moetrace_counts)],
        ),  # fmt: skip
        Target("pmxtrace", folder / "t.pmxtrace", trace_info([]), [("header", pmxtrace_header)]),
        Target("text", folder / "t.txt", trace_info(["--format", "text"]), [("text", mutate_text)]),
        Target("routecsv", folder / "t.csv", trace_info([]), [("text", mutate_text)]),
        Target("moeplan", folder / "p.moeplan", repack, [*json_kinds, ("perm", plan_perm)]),
        Target("pmxplan", folder / "p.pmxplan", repack, [("text", mutate_text)]),
        Target("surface", folder / "s.json", surface_show, json_kinds),
        Target("surface-peer", folder / "peer.json", surface_show, json_kinds),
        Target(
            "q4nx",
            q4nx,
            lambda x, s, r: npu_verify(dump, x),
            [("header-json", q4nx_json), ("header-length", q4nx_length)],
        ),  # fmt: skip
        Target(
            "npu-dump",
            dump,
            lambda x, s, r: npu_verify(x, q4nx),
            [("extend", dump_extend), ("truncate-few", truncate_few)],
        ),  # fmt: skip
        Target(
            "txn",
            folder / "x.txn",
            lambda x, s, r: ["npu", "txn", "decode", str(x), "--json"],
            [("header", txn_header), ("ops", txn_ops)],
        ),  # fmt: skip
    ]


# ---------------------------------------------------------------- running
def run_cli(args: list[str]) -> tuple[int | None, str, str, str | None]:
    """``moepack ARGS`` in process through the real entry point: (exit code, stdout, stderr,
    the traceback of an exception that escaped it, or None)."""
    from moepack.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    crash = None
    code: int | None = None
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(RUN_SECONDS)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Hang:
        crash = f"no result after {RUN_SECONDS} s (blocked or unbounded)"
    except BaseException:  # noqa: BLE001 - exactly what the harness exists to catch
        crash = traceback.format_exc(limit=-4)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return code, out.getvalue(), err.getvalue(), crash


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
    errors = [ln for ln in lines if not ln.startswith("moepack: warning: ")]
    if len(errors) > 1:
        return f"{len(errors)} stderr lines"
    if code != 0 and (not errors or not errors[0].startswith("moepack: error: ")):
        return "a failure without its one-line error"
    return None


def special_paths(folder: Path) -> list[tuple[str, Path]]:
    """Paths that are not regular files, for every reader."""
    fifo = folder / "fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    (folder / "a-folder").mkdir(exist_ok=True)
    return [
        ("fifo", fifo),
        ("folder", folder / "a-folder"),
        ("dev-zero", Path("/dev/zero")),
        ("missing", folder / "missing"),
        ("newline-name", folder / "new\nline"),
    ]


def fuzz(folder: Path, count: int, seed: int) -> dict[str, object]:
    """``count`` mutated inputs spread over every target, plus the special paths once each;
    returns totals and the failures (with the seed that reproduces each)."""
    folder.mkdir(parents=True, exist_ok=True)
    targets = build_targets(folder / "seeds")
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))
    scratch = folder / "scratch"
    scratch.mkdir(exist_ok=True)
    rng = random.Random(seed)
    failures: list[dict[str, object]] = []
    runs = inputs = 0
    per_target: dict[str, int] = {t.name: 0 for t in targets}
    t0 = time.perf_counter()

    def check(target: Target, how: str, path: Path, run_rng: random.Random, case_seed: int) -> None:
        nonlocal runs
        args = target.args(path, scratch, run_rng)
        code, _out, err, crash = run_cli(args)
        runs += 1
        per_target[target.name] += 1
        why = verdict(code, err, crash)
        if why is not None:
            failures.append({"target": target.name, "mutation": how, "seed": case_seed,
                             "args": args, "exit": code, "why": why,
                             "stderr": err[-600:], "traceback": (crash or "")[-1500:]})  # fmt: skip

    for target in targets:
        for how, path in special_paths(folder):
            inputs += 1
            check(target, how, path, random.Random(0), -1)
    for i in range(count):
        case_seed = rng.randrange(1 << 32)
        case_rng = random.Random(case_seed)
        target = targets[i % len(targets)]  # every reader gets the same share
        # structure-aware mutations reach the parsers' checks: three turns to each random one
        how, mutate = case_rng.choice(target.mutators * 3 + RANDOM)
        data = target.seed.read_bytes()
        try:
            mutated = mutate(data, case_rng)
        except (ValueError, KeyError, IndexError, TypeError, struct.error):
            mutated = flip_bits(data, case_rng)  # the seed's structure did not allow it
        path = scratch / f"input-{i % 8}{target.seed.suffix}"
        path.write_bytes(mutated)
        inputs += 1
        check(target, how, path, case_rng, case_seed)
    return {
        "seed": seed,
        "inputs": inputs,
        "runs": runs,
        "failures": failures,
        "per_target": per_target,
        "seconds": round(time.perf_counter() - t0, 1),
        "memory_cap_bytes": MEMORY_CAP,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=200, help="mutated inputs to run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", type=Path, required=True, help="scratch folder")
    ns = ap.parse_args(argv)
    os.environ.setdefault("COLUMNS", "200")
    result = fuzz(ns.dir, ns.count, ns.seed)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
