"""``moepack npu``: pack Qwen3.6-35B-A3B ``.q4nx`` tiles into NPU2 device buffers.

Parsing and rendering only; ``moepack.npu`` computes and returns result objects.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.text import Text

from ..blocklist import format_index_list
from ..errors import BadInput, VerificationFailed
from .options import (
    count_option,
    file_path,
    folder_path,
    force_option,
    json_option,
    layers_option,
    out_option,
    profile_option,
    quiet_option,
    seed_option,
)
from .render import RichProgress, emit, human_bytes, line, put, styled, table

if TYPE_CHECKING:  # the npu modules load when a command runs, not with the CLI
    from ..npu.bufmap import MapResult
    from ..npu.names import NamesInspection
    from ..npu.packer import PackResult
    from ..npu.synth import SynthResult
    from ..npu.txn import TxnResult
    from ..npu.unpack import UnpackResult
    from ..npu.verify import DumpVerifyResult

STATUS_STYLE = {
    "verified": "green",
    "reported": "cyan",
    "claimed": "magenta",
    "inferred": "yellow",
    "unverified": "bold red",
}


def _st(status: str) -> Text:
    return styled(status, STATUS_STYLE.get(status, ""))


def _pct(part: int, whole: int) -> str:
    """A percentage that never rounds a difference away (99.99996% shows as 99.9999%)."""
    if whole == 0:
        return "-"
    v = 100.0 * part / whole
    if part != whole:
        v = min(v, 99.9999)
    return f"{v:.4f}%"


def _hex(n: int) -> str:
    return f"{n:#x}"


# -- profiles -----------------------------------------------------------------------------


@click.command("profiles")
@json_option
def profiles_cmd(as_json: bool) -> None:
    """List the layout profiles and how well each is established."""
    from ..npu.profile import STATUS_HELP
    from ..npu.profiles import DEFAULT, all_profiles

    rows = [
        {
            "name": p.name,
            "default": p.name == DEFAULT,
            "aliases": list(p.aliases),
            "runtime": p.runtime,
            "status": p.provenance.status.value,
            "source": p.provenance.source,
            "summary": p.summary,
        }
        for p in all_profiles()
    ]

    def render(con: Console, res: list[dict[str, Any]]) -> None:
        con.print(
            table(
                "NPU layout profiles",
                ["profile", "runtime", "status", "summary"],
                [
                    [
                        r["name"]
                        + (" (default)" if r["default"] else "")
                        + (f"\naka {', '.join(r['aliases'])}" if r["aliases"] else ""),
                        r["runtime"],
                        _st(r["status"]),
                        r["summary"],
                    ]
                    for r in res
                ],
            )
        )
        parts: list[str | Text] = ["statuses: "]
        for i, (s, h) in enumerate(STATUS_HELP.items()):
            parts += ["; " if i else "", _st(s.value), f" = {h}"]
        put(con, *parts)

    emit(rows, as_json, render)


# -- synth ------------------------------------------------------------------------------


@click.command("synth")
@click.argument("out", type=file_path)
@click.option(
    "--geometry",
    default="scaled",
    show_default=True,
    help="'full' (the real 35B shapes) or 'scaled' (7 experts; everything else real).",
)
@layers_option("0-3", "Layers to include, e.g. 0-39 or 2,3.")
@click.option(
    "--globals",
    "with_globals",
    is_flag=True,
    help="Also write embed_tokens, norm and lm_head (about 1.5 GB at full geometry).",
)
@seed_option("Random seed, 0 or more (bytes depend on seed + name).")
@force_option
@quiet_option
@json_option
def synth_cmd(
    out: Path,
    geometry: str,
    layers: list[int] | None,
    with_globals: bool,
    seed: int,
    force: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Write a synthetic .q4nx with the 35B's tensor names, dtypes, shapes and valid tiles."""
    from ..npu.synth import synth

    res = synth(
        out, geometry, layers, with_globals, seed, RichProgress(not quiet and not as_json), force
    )

    def render(con: Console, r: SynthResult) -> None:
        con.print(
            f"wrote {r.path}: {r.tensors} tensors, {r.bytes:,} B ({human_bytes(r.bytes)}), "
            f"geometry {r.geometry}, layers {format_index_list(r.layers)}"
            + (" + globals" if r.with_globals else "")
        )

    emit(res, as_json, render)


# -- pack / unpack ----------------------------------------------------------------------


@click.command("pack")
@click.argument("model", type=file_path)
@out_option(
    "Folder for the buffer files and manifest.json (created if missing; its parent must exist).",
    folder_path,
    "out_dir",
)
@profile_option("Layout profile (default flm-0.9.46; see 'npu profiles').")
@layers_option(None, "Layers to pack, e.g. 0-39 or 3,7 (default: all in the file).")
@force_option
@click.option(
    "--names",
    "names",
    type=file_path,
    help="Names file binding roles to the file's own tensor names (see 'npu inspect').",
)
@quiet_option
@json_option
def pack_cmd(
    model: Path,
    out_dir: Path,
    profile: str | None,
    layers: list[int] | None,
    force: bool,
    names: Path | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """Pack layers of MODEL into per-layer device buffer files and a manifest."""
    from ..npu.packer import pack_model

    res = pack_model(
        model, out_dir, profile, layers, RichProgress(not quiet and not as_json), force, names
    )

    def render(con: Console, r: PackResult) -> None:
        rows = [
            [b.layer, b.kind, b.buffer, f"{b.size:,}", b.placements, _st(b.weakest), b.sha256[:16]]
            for b in r.buffers
        ]
        con.print(
            table(
                f"{r.profile}: {len(r.layers)} layer(s) -> {r.out_dir}",
                ["layer", "kind", "buffer", "bytes", "placements", "weakest status", "sha256"],
                rows,
                right={0, 3, 4},
            )
        )
        con.print(
            f"{r.total_bytes:,} B ({human_bytes(r.total_bytes)}) written; manifest {r.manifest}"
        )
        if r.unplaced:
            put(
                con,
                styled(f"{len(r.unplaced)} tensor(s) not in any buffer of this profile", "yellow"),
                " (see manifest.json 'unplaced')",
            )

    emit(res, as_json, render)


@click.command("unpack")
@click.argument("pack_dir", type=folder_path)
@out_option("The .q4nx to write.", file_path)
@click.option(
    "--check",
    "check_model",
    type=file_path,
    default=None,
    help="Compare every retained byte with this model; if any differs, exit 1 and write nothing.",
)
@click.option(
    "--allow-other-model",
    is_flag=True,
    help="With --check: compare even though the model is not the one the pack was "
    "made from (its size or header differs from the manifest's fingerprint).",
)
@click.option(
    "--no-hash-check", is_flag=True, help="Skip checking buffer files against their sha256."
)
@quiet_option
@json_option
@force_option
def unpack_cmd(
    pack_dir: Path,
    out: Path,
    check_model: Path | None,
    allow_other_model: bool,
    no_hash_check: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Rebuild the source tensors of a pack folder as a .q4nx (unretained bytes are zero)."""
    from ..npu.unpack import unpack

    res = unpack(
        pack_dir,
        out,
        check_model,
        RichProgress(not quiet and not as_json),
        not no_hash_check,
        allow_other_model,
    )

    def render(con: Console, r: UnpackResult) -> None:
        rows = [
            [t.name, f"{t.retained:,}", f"{t.nbytes:,}", _pct(t.retained, t.nbytes)]
            + ([f"{r.check_mismatches.get(t.name, 0):,}"] if r.checked_against else [])
            for t in r.tensors
        ]
        cols = ["tensor", "retained", "bytes", "kept"] + (["differ"] if r.checked_against else [])
        title = f"unpacked {r.pack_dir} ({r.profile})" + (f" -> {r.out}" if r.written else "")
        con.print(table(title, cols, rows, right={1, 2, 3, 4}))
        if r.left_out:
            con.print(f"left out (nothing retained): {', '.join(r.left_out)}")
        if r.checked_against:
            if r.other_model:
                put(
                    con,
                    styled(f"{r.checked_against} is not the pack's model:", "yellow"),
                    f" {r.other_model}",
                )
            verdict = (
                styled("all retained bytes match", "green")
                if not r.differing
                else styled(f"{r.differing:,} bytes differ; nothing written to {r.out}", "red")
            )
            put(con, f"checked against {r.checked_against}: ", verdict)

    emit(res, as_json, render)
    if res.checked_against and res.differing:
        worst = max(res.check_mismatches.items(), key=lambda kv: kv[1])
        raise VerificationFailed(
            f"{res.differing:,} retained bytes differ from {res.checked_against} (most in "
            f"{worst[0]}: {worst[1]:,}); nothing was written to {res.out}",
            pack_dir,
        )


# -- map ----------------------------------------------------------------------------------


@click.command("map")
@profile_option("Layout profile (default flm-0.9.46).")
@count_option("--layer", 0, "Layer number (3, 7, ... are full attention).", low=0)
@click.option(
    "--model",
    type=file_path,
    default=None,
    help="Take the geometry from this .q4nx.",
)
@click.option(
    "--geometry", default="full", show_default=True, help="'full' or 'scaled' (without --model)."
)
@json_option
def map_cmd(
    profile: str | None, layer: int, model: Path | None, geometry: str, as_json: bool
) -> None:
    """Show a profile's buffer map: region, offset, size, tensor, units, order, scheme, status."""
    from ..npu.bufmap import map_layer

    emit(map_layer(profile, layer, model, geometry), as_json, _render_map)


def _render_map(con: Console, r: MapResult) -> None:
    put(con, styled(r.profile, "bold"), f" ({r.runtime}) - {r.summary}")
    con.print(f"layer {r.layer} ({r.kind} attention), geometry {r.geometry}")
    put(con, "tensor names: ", _st(r.names_status), f" ({r.names_source}); {r.names_note}")
    for b in r.buffers:
        arg = f"arg {b.arg}" if b.arg is not None else "arg ?"
        title = line(
            f"{b.name} ({arg}): {b.size:,} B = {_hex(b.size)}, size ",
            _st(b.size_status),
            f" ({b.size_source})",
        )
        rows = [
            [
                row.region,
                _hex(row.offset),
                f"{row.size:,}",
                row.tensor,
                row.units,
                "pair512" if row.scheme.startswith("pairs") else row.scheme,
                _st(row.status),
            ]
            for row in b.rows
        ]
        con.print(
            table(
                title,
                ["region", "offset", "bytes", "tensor", "units", "scheme", "status"],
                rows,
                right={1, 2},
            )
        )
        orders: dict[str, list[str]] = {}
        for row in b.rows:
            if row.rule not in ("-", "as stored"):
                orders.setdefault(row.rule, []).append(row.tensor)
        for rule, tensors in orders.items():
            con.print(f"  order of {', '.join(dict.fromkeys(tensors))}: {rule}")
        notes: dict[tuple[str, str, str], list[str]] = {}
        for row in b.rows:
            if row.status in ("unverified", "claimed", "inferred") and row.note:
                notes.setdefault((row.status, row.source, row.note), []).append(row.tensor)
        for (status, source, note), tensors in notes.items():
            put(con, "  ", _st(status), f" {', '.join(dict.fromkeys(tensors))}: {source}; {note}")
    if r.unplaced:
        con.print(styled("not placed by this profile:", "yellow"))
        for name, why in r.unplaced.items():
            con.print(f"  {name}: {why}")


# -- verify -------------------------------------------------------------------------------


@click.command("verify")
@click.option(
    "--dump",
    "dump",
    required=True,
    type=file_path,
    help="A captured device buffer.",
)
@click.option("--model", required=True, type=file_path)
@click.option("--layer", required=True, type=click.IntRange(min=0))
@click.option(
    "--buffer", default="weights", show_default=True, help="weights, router, norms or attn_norms."
)
@profile_option("A profile, or 'auto' to try every profile and rank them.")
@count_option(
    "--mismatches",
    10,
    "How many mismatching units to list (0: none).",
    low=0,
    dest="max_mismatches",
)
@count_option(
    "--locate",
    0,
    "Search the model for where the first N mismatching units really came from.",
    low=0,
    dest="locate_n",
)
@quiet_option
@json_option
def verify_cmd(
    dump: Path,
    model: Path,
    layer: int,
    buffer: str,
    profile: str | None,
    max_mismatches: int,
    locate_n: int,
    quiet: bool,
    as_json: bool,
) -> None:
    """Compare a captured buffer with what a profile produces (exit 1 if it differs)."""
    from ..npu.verify import verify_dump

    res = verify_dump(
        dump,
        model,
        layer,
        buffer,
        profile,
        max_mismatches,
        locate_n,
        RichProgress(not quiet and not as_json),
    )
    emit(res, as_json, _render_verify)
    if not res.match:
        b = res.best
        first = f"; first mismatch at {_hex(b.mismatches[0].offset)}" if b.mismatches else ""
        raise VerificationFailed(
            f"layer {res.layer} {res.buffer}: best profile {b.profile} matches "
            f"{_pct(b.matching, b.judged)} ({b.judged - b.matching:,} bytes differ){first}",
            dump,
        )


def _render_verify(con: Console, r: DumpVerifyResult) -> None:
    con.print(f"dump {r.dump} ({r.dump_size:,} B) vs layer {r.layer} ({r.kind}) {r.buffer}")
    con.print(
        table(
            "profiles",
            ["rank", "profile", "match", "bytes differing", "note"],
            [
                [
                    i + 1,
                    s.profile,
                    _pct(s.matching, s.judged) if s.comparable else "-",
                    f"{s.judged - s.matching:,}" if s.comparable else "-",
                    s.reason,
                ]
                for i, s in enumerate(r.scores)
            ],
            right={0, 2, 3},
        )
    )
    b = r.best
    if not b.comparable:
        return
    prefix = f"model.layer.{r.layer}."
    rows = [
        [
            p.region,
            _hex(p.offset),
            p.tensor.removeprefix(prefix),
            f"{p.nbytes:,}",
            _pct(p.matching, p.nbytes),
            _st(p.status),
        ]
        for p in b.placements
    ]
    rows.append(
        [
            "",
            "",
            "(zero)",
            f"{b.zero_bytes:,}",
            f"{100.0 * b.zero_matching / b.zero_bytes:.2f}%" if b.zero_bytes else "-",
            "",
        ]
    )
    con.print(
        table(
            f"{b.profile}: per placement",
            ["region", "offset", "tensor", "bytes", "match", "status"],
            rows,
            right={1, 3, 4},
        )
    )
    if b.mismatches:
        mrows = []
        for m in b.mismatches:
            where = m.source.text() if m.source else "zero region"
            loc = m.located.text() if m.located else ""
            mrows.append(
                [
                    _hex(m.offset),
                    f"{m.differing:,}/{m.unit_length:,}",
                    f"{m.expected:#04x}",
                    f"{m.got:#04x}",
                    where,
                    loc,
                ]
            )
        con.print(
            table(
                f"{b.profile}: first mismatching units",
                ["offset", "differ", "expected", "got", "-> source", "found in model"],
                mrows,
                right={1},
            )
        )
    elif b.matching != b.compared:  # they differ, but --mismatches 0 listed none
        put(
            con,
            styled(
                f"{b.profile}: {b.compared - b.matching:,} of the {b.compared:,} B compared differ",
                "red",
            ),
            " (no units listed: --mismatches 0)",
        )
    elif b.size_differs:
        put(
            con,
            styled(f"{b.profile}: byte-identical over the {b.compared:,} B compared", "green"),
            "; ",
            styled("the sizes differ", "yellow"),
            f" ({b.reason})",
        )
    else:
        con.print(styled(f"{b.profile}: byte-identical ({b.size:,} B)", "green"))


# -- inspect --------------------------------------------------------------------------------


@click.command("inspect")
@click.argument("model", type=file_path)
@profile_option("Layout profile whose roles to fill (default flm-0.9.46).")
@click.option(
    "--write-names",
    "write_names",
    type=file_path,
    help="Write the proposed binding as a names file to start from (for 'npu pack --names').",
)
@json_option
@force_option
def inspect_cmd(model: Path, profile: str | None, write_names: Path | None, as_json: bool) -> None:
    """List MODEL's tensors and the profile role each fills (by name, else by a unique dtype
    and shape), and which roles are ambiguous or missing."""
    from ..npu.names import inspect_file

    res = inspect_file(model, profile, write_names)

    def render(con: Console, r: NamesInspection) -> None:
        rows = [
            [t.name, t.dtype, "x".join(map(str, t.shape)), f"{t.bytes:,}", t.role or "-", t.how]
            for t in r.tensors
        ]
        con.print(
            table(
                f"{r.path}: {len(r.tensors)} tensors, geometry {r.geometry}, profile {r.profile}",
                ["tensor", "dtype", "shape", "bytes", "role", "matched by"],
                rows,
                right={3},
            )
        )
        for role, template in r.roles.items():
            con.print(f"role {role}: {template}")
        for role, candidates in r.ambiguous.items():
            put(con, styled("ambiguous", "yellow"), f" {role}: {', '.join(candidates)}")
        for role, layers in r.missing.items():
            put(con, styled("missing", "red"), f" {role}: layers {format_index_list(layers)}")
        for note in r.notes:
            con.print(note)
        if r.names_file:
            con.print(f"names file written: {r.names_file}")

    emit(res, as_json, render)


# -- txn ------------------------------------------------------------------------------------


def _dims_text(d: dict[str, Any]) -> list[str]:
    """A BD's dimensions as ``wrap×stride`` (words; ``-`` for a dimension that never wraps)."""
    return [f"{x['wrap'] or '-'}×{x['stride']}" for x in d["dims"]]


BD_COLUMNS = (
    "op",
    "byte",
    "tile",
    "bd",
    "length (words)",
    "base",
    "d0",
    "d1",
    "d2/d3",
    "iteration",
    "packet",
    "locks",
    "next",
    "valid",
    "queue",
    "fields (nonzero)",
)
"""``_bd_row``'s columns, in its order: one row per buffer descriptor."""


def _bd_row(bd: Any) -> list[Any]:
    d = bd.to_json()
    f = d["fields"]
    dims = _dims_text(d) + [""] * 3
    it = d["iteration"]
    packet = f"id {f['packet_id']} type {f['packet_type']}" if f.get("enable_packet") else "-"
    locks = "-"
    if f.get("lock_acq_enable") or f.get("lock_rel_value"):
        locks = (
            f"acq {f['lock_acq_id']}:{f['lock_acq_value']} rel {f['lock_rel_id']}:"
            f"{f['lock_rel_value']}"
        )
    queue = "-"
    if bd.pushes:
        p = bd.pushes[0]
        more = f" (+{len(bd.pushes) - 1})" if len(bd.pushes) > 1 else ""
        queue = f"{p.direction} {p.channel} ×{bd.runs}{more}"
    named = " ".join(f"{k}={v}" for k, v in f.items() if v)
    return [
        bd.op_index,
        _hex(bd.offset),
        f"{bd.kind} ({bd.column},{bd.row})",
        bd.bd_id,
        f"{bd.length_words:,}",
        _hex(d["base_address"]),
        dims[0],
        dims[1],
        " ".join(x for x in dims[2:] if x) or "-",
        f"{it['wrap']}×{it['stride']}@{it['current']}",
        packet,
        locks,
        d["next_bd"] if d["next_bd"] is not None else "-",
        "yes" if d["valid"] else "no",
        queue,
        named,
    ]


def _patch_region(p: Any) -> str:
    if p.unknown_region:
        return p.unknown_region
    if p.region is None:
        return "?"
    sp = p.spans()
    if sp is None:
        return "too many spans: bounds only"
    return f"{len(sp):,} span{'s' if len(sp) != 1 else ''}, {sum(n for _, n in sp):,} B"


@click.command("decode")
@click.argument("file", type=file_path)
@click.option(
    "--all", "show_all", is_flag=True, help="List every buffer descriptor and patch record."
)
@json_option
def txn_decode_cmd(file: Path, show_all: bool, as_json: bool) -> None:
    """Decode a TXN stream (raw, or the .ctrltext section of an ELF): operations, buffer
    descriptors field by field, DMA task-queue writes, scratchpads, patch records, and the
    regions each kernel argument is read or written at."""
    from ..npu.txn import READ_REGS_FORMS, decode_file

    res = decode_file(file)

    def render(con: Console, r: TxnResult) -> None:
        for i, s in enumerate(r.streams):
            h = s.header
            put(
                con,
                styled(f"stream {i}", "bold"),
                f" at byte {s.offset:#x} ({r.container}): header "
                f"{h['w0']:#010x} ({s.device}, v{h['major']}.{h['minor']}, dev_gen {h['dev_gen']}, "
                f"{h['rows']} rows x {h['cols']} cols), {h['num_ops']:,} ops declared, "
                f"{s.words:,} words",
            )
            counts = s.op_counts()
            con.print(
                table(
                    "operations",
                    ["op", "count"],
                    [[k, f"{v:,}"] for k, v in counts.items()],
                    right={1},
                )
            )
            if s.read_regs_forms:
                forms = ", ".join(
                    f"{READ_REGS_FORMS[k]} ×{v:,}" for k, v in sorted(s.read_regs_forms.items())
                )
                con.print(f"READ_REGS forms: {forms}")
            for pad in s.scratchpads:
                read = ", ".join(str(e) for e in pad.entries_read) or "none"
                con.print(
                    f"scratchpad at byte {s.offset + pad.offset:#x}: {pad.size:,} B "
                    f"({pad.entries:,} state-table entries, usage type {pad.usage_type}), read by "
                    f"{pad.readers:,} UPDATE_REG (entries {read}); the runtime's buffer, not a "
                    "kernel argument"
                )
            unpaired = f" ({s.unpaired:,} unpaired: region unknown)" if s.unpaired else ""
            kinds = ", ".join(f"{k} {v:,}" for k, v in s.bd_counts().items())
            con.print(
                f"{len(s.bds):,} buffer descriptors{f' ({kinds})' if kinds else ''}, "
                f"{len(s.patches):,} patch records{unpaired}"
            )
            if s.pushes:
                dirs: dict[str, int] = {}
                for q in s.pushes:
                    dirs[f"{q.kind} {q.direction}"] = dirs.get(f"{q.kind} {q.direction}", 0) + 1
                con.print(
                    f"{len(s.pushes):,} task-queue writes: "
                    + ", ".join(f"{k} {v:,}" for k, v in dirs.items())
                )
            summaries = s.regions()
            if summaries:
                con.print(
                    "regions: each patched BD's bytes from its decoded length, d0/d1/d2 wraps "
                    "and strides, iteration and task-queue repeats (not a fixed span); read = "
                    "an MM2S channel runs it, write = S2MM, unknown = no queue write names it"
                )
            for a in summaries:
                runs = [
                    [
                        _hex(x.offset),
                        f"{x.length:,}",
                        f"{x.count:,}",
                        f"{x.stride:,}" if x.count > 1 else "-",
                        _hex(x.end),
                    ]
                    for x in a.runs
                ]
                bounded = f", {a.bounds_only:,} by bounds only" if a.bounds_only else ""
                con.print(
                    table(
                        f"arg {a.arg_idx} {a.access}: {a.patches:,} "
                        f"patch{'es' if a.patches != 1 else ''}{bounded}, "
                        f"{a.bytes:,} B, {_hex(a.lo)}-{_hex(a.hi)}",
                        ["offset", "length", "count", "stride", "end"],
                        runs,
                        right={1, 2, 3},
                    )
                )
            if show_all:
                con.print(
                    table(
                        "buffer descriptors (dims: wrap×stride in words, '-' never wraps)",
                        list(BD_COLUMNS),
                        [_bd_row(d) for d in s.bds],
                        right={0, 3, 4},
                    )
                )
                con.print(
                    table(
                        "patch records",
                        ["op", "byte", "reg", "arg", "arg offset", "bd length", "access", "region"],
                        [
                            [
                                p.op_index,
                                _hex(p.offset),
                                _hex(p.reg),
                                p.arg_idx,
                                _hex(p.arg_offset),
                                f"{p.bd.length_bytes:,}" if p.bd else "?",
                                p.access,
                                _patch_region(p),
                            ]
                            for p in s.patches
                        ],
                        right={0, 3},
                    )
                )
            for p in s.warnings:
                put(con, styled(f"warning at byte {p.offset:#x}:", "yellow"), f" {p.text()}")
            for p in s.problems:
                put(con, styled(f"problem at byte {p.offset:#x}:", "red"), f" {p.message}")
        for c in r.reference:
            mark = styled("matches", "green") if c.ok else styled("differs", "yellow")
            put(
                con,
                f"ref §7 {c.reference} (by {c.identified_by}): {c.quantity} {c.got:,}, "
                f"reference {c.expected:,}: ",
                mark,
            )

    emit(res, as_json, render)
    probs = res.problems
    if probs:
        more = f" (and {len(probs) - 1} more)" if len(probs) > 1 else ""
        raise BadInput(probs[0].message + more, file)
