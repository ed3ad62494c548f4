"""``moepack repack`` and ``repack --undo``: parsing and rendering only (the library is
``rewrite.repack`` and ``rewrite.undo``)."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from ..errors import BadInput
from ..layout.plan import load_plan
from ..rewrite.repack import RepackResult, repack
from ..rewrite.undo import undo as undo_repack
from .options import (
    SizeType,
    assume_options,
    force_option,
    input_path,
    json_option,
    out_option,
    quiet_option,
)
from .render import RichProgress, emit, human_bytes, warn


def _render_repack(con: Console, r: RepackResult) -> None:
    for o in r.outputs:
        con.print(f"wrote {o}")
    fused = f", {len(r.blocks_fused)} blocks fused" if r.blocks_fused else ""
    con.print(
        f"layout {r.layout} (alignment {r.alignment}): {len(r.blocks_permuted)} blocks "
        f"permuted{fused}, {r.tensors_permuted} tensors permuted, {r.tensors_copied} copied "
        f"byte for byte; {human_bytes(r.bytes_written)} in {r.seconds:.2f} s"
    )
    con.print(
        "permutation and layout recorded in the file's metadata"
        if r.provenance_recorded
        else "no provenance keys written"
    )
    for n in r.notes:
        con.print(n)


@click.command("repack")
@click.argument("model", type=input_path)
@click.option("--plan", "plan_path", type=input_path, help="Plan (.moeplan or .pmxplan).")
@click.option(
    "--undo",
    is_flag=True,
    help="Return a repacked MODEL to its original order (from its provenance).",
)
@click.option(
    "--layout",
    default=None,
    help="reorder, fused, pipeline, identity or a + combination (fused+reorder); "
    "default reorder with --plan. fused only where llama.cpp's loader takes ffn_gate_up_exps.",
)
@click.option(
    "--align",
    "alignment",
    type=click.IntRange(min=0),
    default=0,
    help="Start every tensor (and every slice whose size allows) on this power of two "
    "(general.alignment); default the model's own.",
)
@click.option(
    "--split-max-size",
    type=SizeType(),
    default=None,
    help="Cut the output into shards of at most this much tensor data (like gguf-split's; "
    "binary units: 4G), on block boundaries. Default: the input's shards, cut anew on block "
    "boundaries only where a block --layout packs spans two.",
)
@out_option("Output GGUF (split inputs give split outputs).")
@click.option(
    "--keep-header", is_flag=True, help="Keep the header byte-identical (records no provenance)."
)
@assume_options
@json_option
@quiet_option
@force_option
def repack_cmd(
    model: Path,
    plan_path: Path | None,
    undo: bool,
    layout: str | None,
    alignment: int,
    split_max_size: int | None,
    out: Path,
    keep_header: bool,
    assume_expert: tuple[str, ...],
    assume_not_expert: tuple[str, ...],
    as_json: bool,
    quiet: bool,
) -> None:
    """Write a drop-in copy of MODEL with experts reordered by a plan and/or laid out anew
    (fused gate+up, pipeline order, aligned), or undo such a copy from its provenance."""
    progress = RichProgress(not quiet and not as_json)
    if undo:
        if plan_path is not None or layout is not None or alignment or split_max_size:
            raise BadInput(
                "--undo takes no --plan, --layout, --align or --split-max-size: the file says "
                "what to undo"
            )
        result = undo_repack(model, out, progress=progress)
        emit(result, as_json, _render_repack)
        return
    if plan_path is None and layout is None and not alignment and split_max_size is None:
        raise BadInput(
            "give --plan PLAN, --layout LAYOUT, --align N, or --undo (or --split-max-size "
            "SIZE to cut the shards anew)"
        )
    plan = load_plan(plan_path) if plan_path is not None else None
    result = repack(
        model,
        plan,
        out,
        keep_header=keep_header,
        plan_path=plan_path,
        progress=progress,
        assume_expert=assume_expert,
        assume_not_expert=assume_not_expert,
        layout=layout,
        alignment=alignment,
        split_max_size=split_max_size,
    )
    warn(result.warnings)
    emit(result, as_json, _render_repack)
