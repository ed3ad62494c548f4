"""CLI for the GGUF half: inspect, synth, plan, repack, verify, demo."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.console import Console

from ..checkpoint.inspect import InspectResult, inspect_model
from ..errors import VerificationFailed
from ..layout.plan import load_plan
from ..rewrite.repack import RepackResult, repack
from ..rewrite.verify import VerifyResult, verify
from .common import json_option, quiet_option
from .render import RichProgress, emit, human_bytes, table

assume_options = [
    click.option(
        "--assume-expert",
        multiple=True,
        metavar="GLOB",
        help="Treat tensors matching GLOB as expert-axis tensors (settles ambiguous ones).",
    ),
    click.option(
        "--assume-not-expert",
        multiple=True,
        metavar="GLOB",
        help="Treat tensors matching GLOB as not carrying the expert axis.",
    ),
]


def _apply(options: list[Any]):  # noqa: ANN202
    def deco(f):  # noqa: ANN001, ANN202
        for o in reversed(options):
            f = o(f)
        return f

    return deco


# ------------------------------------------------------------------ inspect
def _render_inspect(con: Console, r: InspectResult) -> None:
    shards = f" ({len(r.shards)} shards)" if len(r.shards) > 1 else ""
    con.print(f"[bold]{r.path}[/bold]{shards}")
    rows = [
        ["architecture", r.architecture],
        ["GGUF version / alignment", f"{r.gguf_version} / {r.alignment}"],
        ["file size", f"{human_bytes(r.file_bytes)} ({r.file_bytes:,} B)"],
        ["tensors", r.n_tensors],
        ["blocks", f"{r.block_count} ({len(r.moe_blocks)} MoE, {len(r.dense_blocks)} dense)"],
        ["experts / top-k", f"{r.n_expert if r.n_expert >= 0 else 'varies'} / {r.top_k}"],
        [
            "expert bytes",
            f"{human_bytes(r.expert_bytes)} = {100 * r.expert_share:.1f} % of the file",
        ],
        ["fingerprint", r.fingerprint],
    ]
    if r.provenance:
        blocks = r.provenance.get("moepack.repack.blocks", "")
        rows.append(
            [
                "repacked by moepack",
                f"from {r.provenance.get('moepack.repack.original_fingerprint')}, blocks {blocks}",
            ]
        )
    con.print(table(None, ["model", ""], rows))
    if not r.layers:
        con.print(
            "No MoE blocks found (no tensor has the expert count as its outermost dimension)."
        )
    else:
        lrows = []
        for layer in r.layers:
            lrows.append(
                [
                    layer.block,
                    layer.n_expert,
                    layer.top_k,
                    "\n".join(f"{t.name.split('.', 2)[2]}" for t in layer.tensors),
                    "\n".join(f"{t.type}" for t in layer.tensors),
                    "\n".join(f"{t.bits_per_weight:.2f}" for t in layer.tensors),
                    "\n".join(human_bytes(t.slice_bytes) for t in layer.tensors),
                    human_bytes(layer.bytes_per_expert),
                ]
            )
        con.print(
            table(
                "MoE blocks",
                [
                    "block",
                    "experts",
                    "top-k",
                    "expert-axis tensors",
                    "type",
                    "bits/w",
                    "slice",
                    "bytes/expert",
                ],
                lrows,
                right={0, 1, 2, 5, 6, 7},
            )
        )
    if r.flagged:
        con.print(
            table(
                "Tensors left alone (reported, not guessed)",
                ["tensor", "role", "reason"],
                [[f.name, f.role, f.reason] for f in r.flagged],
            )
        )


@click.command("inspect")
@click.argument("model", type=click.Path(path_type=Path))
@_apply(assume_options)
@json_option
def inspect_cmd(
    model: Path, assume_expert: tuple[str, ...], assume_not_expert: tuple[str, ...], as_json: bool
) -> None:
    """Where MODEL's expert bytes sit: per model and per MoE block (any shard of a split file)."""
    emit(inspect_model(model, assume_expert, assume_not_expert), as_json, _render_inspect)


# ------------------------------------------------------------------ repack
def _render_repack(con: Console, r: RepackResult) -> None:
    for o in r.outputs:
        con.print(f"wrote {o}")
    con.print(
        f"{len(r.blocks_permuted)} blocks permuted, {r.tensors_permuted} tensors permuted, "
        f"{r.tensors_copied} copied byte for byte; {human_bytes(r.bytes_written)} in {r.seconds:.2f} s"
    )
    con.print(
        "permutation recorded in the file's metadata"
        if r.provenance_recorded
        else "header unchanged (no provenance keys)"
    )
    for n in r.notes:
        con.print(n)


@click.command("repack")
@click.argument("model", type=click.Path(path_type=Path))
@click.option(
    "--plan",
    "plan_path",
    required=True,
    type=click.Path(path_type=Path),
    help="Plan (.moeplan or .pmxplan).",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(path_type=Path),
    help="Output GGUF (split inputs give split outputs).",
)
@click.option(
    "--keep-header", is_flag=True, help="Keep the header byte-identical (records no provenance)."
)
@json_option
@quiet_option
def repack_cmd(
    model: Path, plan_path: Path, out: Path, keep_header: bool, as_json: bool, quiet: bool
) -> None:
    """Write a drop-in copy of MODEL with each planned block's experts reordered."""
    plan = load_plan(plan_path)
    result = repack(
        model,
        plan,
        out,
        keep_header=keep_header,
        plan_path=plan_path,
        progress=RichProgress(not quiet and not as_json),
    )
    emit(result, as_json, _render_repack)


# ------------------------------------------------------------------ verify
def _render_verify(con: Console, r: VerifyResult) -> None:
    con.print(
        f"{r.tensors_compared} tensors compared, {r.tensors_identical} byte-identical, "
        f"{r.tensors_permuted} matched as a permutation ({len(r.blocks_permuted)} blocks; "
        f"permutation from {r.permutation_source}); {r.metadata_keys} metadata keys equal"
    )
    con.print(f"{human_bytes(r.bytes_compared)} compared in {r.seconds:.2f} s")
    if r.ok:
        con.print(
            "[bold green]OK[/bold green] — the repacked file holds exactly the original weights."
        )
    else:
        d = r.difference
        assert d is not None
        where = f" (offset {d.offset:,})" if d.offset is not None else ""
        con.print(f"[bold red]VERIFICATION FAILED[/bold red] — {d.file}: {d.message}{where}")


@click.command("verify")
@click.argument("original", type=click.Path(path_type=Path))
@click.argument("repacked", type=click.Path(path_type=Path))
@click.option(
    "--plan", "plan_path", type=click.Path(path_type=Path), help="Check against this plan too."
)
@json_option
@quiet_option
def verify_cmd(
    original: Path, repacked: Path, plan_path: Path | None, as_json: bool, quiet: bool
) -> None:
    """Account for every byte of REPACKED against ORIGINAL; exit 1 naming the first difference."""
    plan = load_plan(plan_path) if plan_path else None
    result = verify(
        original, repacked, plan, plan_path, progress=RichProgress(not quiet and not as_json)
    )
    emit(result, as_json, _render_verify)
    if not result.ok:
        d = result.difference
        assert d is not None
        raise VerificationFailed(d.message, d.file)


def register(cli: click.Group) -> None:
    """Add the GGUF commands to ``cli``."""
    cli.add_command(inspect_cmd)
    cli.add_command(repack_cmd)
    cli.add_command(verify_cmd)
