"""CLI for expert stores: ``store build`` and ``store verify`` render the library's results."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from ..layout.plan import load_plan
from ..store.build import DEFAULT_ALIGNMENT, BuildResult, build_store
from .options import json_option, out_option, path_out, quiet_option
from .render import RichProgress, emit, human_bytes, warn


@click.group("store")
def store_group() -> None:
    """Expert-major stores: each routed expert's slices in one aligned record."""


def _render_build(con: Console, r: BuildResult) -> None:
    con.print(f"wrote {r.out}")
    con.print(
        f"{r.experts} experts of {len(r.blocks)} MoE blocks ({r.layout}, records aligned to "
        f"{r.alignment:,} B): {human_bytes(r.payload_bytes)} of expert bytes, "
        f"{human_bytes(r.padding_bytes)} of padding and index, in {r.seconds:.2f} s"
    )
    if r.precision:
        p = r.precision
        con.print(
            f"precision plan: {p['requantised']} experts requantised; "
            f"{human_bytes(p['bytes_saved'])} saved against the source types"
        )


@store_group.command("build")
@click.argument("model", type=path_out)
@out_option("Store to write (.moestore).")
@click.option("--plan", "plan_path", type=path_out, help="Expert order (.moeplan or .pmxplan).")
@click.option(
    "--alignment",
    type=int,
    default=DEFAULT_ALIGNMENT,
    show_default=True,
    help="Record alignment in bytes (a power of two, at least 4096: O_DIRECT-safe).",
)
@json_option
@quiet_option
def build_cmd(
    model: Path,
    out: Path,
    plan_path: Path | None,
    alignment: int,
    as_json: bool,
    quiet: bool,
) -> None:
    """Write MODEL's routed experts as an expert-major store (dense tensors stay in MODEL)."""
    plan = load_plan(plan_path) if plan_path is not None else None
    result = build_store(
        model,
        out,
        plan=plan,
        plan_path=plan_path,
        alignment=alignment,
        progress=RichProgress(not quiet and not as_json),
    )
    warn(result.warnings)
    emit(result, as_json, _render_build)


def register(cli: click.Group) -> None:
    """Add the ``store`` commands to ``cli``."""
    cli.add_command(store_group)
