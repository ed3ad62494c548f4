"""``moepack inspect``: parsing and rendering only (the library is ``checkpoint.inspect``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.console import Console

from .. import keys
from ..checkpoint.inspect import InspectResult, inspect_model
from .options import assume_options, input_path, json_option
from .render import emit, human_bytes, put, styled, table


def _render_inspect(con: Console, r: InspectResult) -> None:
    shards = f" ({len(r.shards)} shards)" if len(r.shards) > 1 else ""
    put(con, styled(r.path, "bold"), shards)
    rows: list[list[Any]] = [
        ["architecture", r.architecture],
        ["GGUF version / alignment", f"{r.gguf_version} / {r.alignment}"],
        ["file size", f"{human_bytes(r.file_bytes)} ({r.file_bytes:,} B)"],
        ["tensors", r.n_tensors],
        ["blocks", f"{r.block_count} ({len(r.moe_blocks)} MoE, {len(r.dense_blocks)} dense)"],
    ]
    if r.not_run_blocks:
        rows.append(
            [
                "not run by llama.cpp",
                f"{'blocks' if len(r.not_run_blocks) > 1 else 'block'} "
                f"{', '.join(map(str, r.not_run_blocks))}: next-token prediction (MTP)",
            ]
        )
    rows += [
        ["experts / top-k", f"{r.n_expert if r.n_expert >= 0 else 'varies'} / {r.top_k}"],
    ]
    if r.expert_groups > 1:
        rows.append(
            [
                "routing groups",
                f"{r.expert_groups} groups, {r.expert_groups_used} chosen per token "
                f"(experts move only within a group or with their group)",
            ]
        )
    rows += [
        [
            "expert bytes",
            f"{human_bytes(r.expert_bytes)} = {100 * r.expert_share:.1f} % of the file",
        ],
        ["fingerprint", r.fingerprint],
    ]
    if r.provenance:
        blocks = r.provenance.get(keys.REPACK_BLOCKS, "")
        rows.append(
            [
                "repacked by moepack",
                f"from {r.provenance.get(keys.REPACK_ORIGINAL)}, blocks {blocks}",
            ]
        )
        if keys.REPACK_ORDER in r.provenance:
            fused = r.provenance.get(keys.REPACK_FUSED)
            was = r.provenance.get(keys.REPACK_ALIGNMENT)
            parts = [f"gate+up fused in blocks {fused}" if fused else "nothing fused"]
            if was is not None:
                parts.append(f"original alignment {was or 'default (32)'}")
            rows.append(["moepack layout", "; ".join(parts) + "; original tensor order recorded"])
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
                    layer.block if layer.runs else f"{layer.block} (not run)",
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
    rules = [(layer.block, c) for layer in r.layers for c in layer.constraints]
    if rules:
        con.print(
            table(
                "Expert order rules (llama.cpp reads expert indices here)",
                ["block", "rule", "group size", "groups move", "detail"],
                [
                    [
                        b,
                        c["kind"],
                        c["group_size"],
                        "yes" if c["movable"] else "no",
                        c["description"],
                    ]
                    for b, c in rules
                ],
                right={0, 2},
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
@click.argument("model", type=input_path)
@assume_options
@json_option
def inspect_cmd(
    model: Path, assume_expert: tuple[str, ...], assume_not_expert: tuple[str, ...], as_json: bool
) -> None:
    """Where MODEL's expert bytes sit: per model and per MoE block (any shard of a split file)."""
    emit(inspect_model(model, assume_expert, assume_not_expert), as_json, _render_inspect)
