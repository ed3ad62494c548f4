"""``moepack verify``: parsing and rendering only (the library is ``rewrite.verify``)."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from ..binding import shape_only_warning
from ..errors import VerificationFailed
from ..layout.plan import load_plan
from ..rewrite.verify import VerifyResult, verify
from .options import assume_options, input_path, json_option, quiet_option
from .render import RichProgress, emit, human_bytes, put, styled, warn

_SOURCE = {
    "provenance": "from the file's provenance",
    "plan": "from the plan",
    "discovered": "discovered from the bytes",
    "identity": "none",
}


def _render_verify(con: Console, r: VerifyResult) -> None:
    d = r.difference
    if d is not None and d.what == "format":
        put(con, styled("VERIFICATION FAILED", "bold red"), f" — {d.file}: {d.message}")
        return
    con.print(
        f"{r.tensors_compared} tensors compared, {r.tensors_identical} byte-identical, "
        f"{r.tensors_permuted} matched as permuted or fused ({len(r.blocks_permuted)} blocks; "
        f"permutation {_SOURCE.get(r.permutation_source, r.permutation_source)}); "
        f"{r.metadata_keys} metadata keys equal"
    )
    if r.blocks_fused or r.tensor_order != "original" or r.alignment:
        fused = f"gate+up fused in {len(r.blocks_fused)} blocks, " if r.blocks_fused else ""
        con.print(f"layout: {fused}tensor order {r.tensor_order}, alignment {r.alignment}")
    con.print(f"{human_bytes(r.bytes_compared)} compared in {r.seconds:.2f} s")
    if r.ok:
        put(
            con,
            styled("OK", "bold green"),
            " — the repacked file holds exactly the original weights.",
        )
    else:
        d = r.difference
        assert d is not None
        where = f" (offset {d.offset:,})" if d.offset is not None else ""
        put(con, styled("VERIFICATION FAILED", "bold red"), f" — {d.file}: {d.message}{where}")


@click.command("verify")
@click.argument("original", type=input_path)
@click.argument("repacked", type=input_path)
@click.option("--plan", "plan_path", type=input_path, help="Check against this plan too.")
@assume_options
@json_option
@quiet_option
def verify_cmd(
    original: Path,
    repacked: Path,
    plan_path: Path | None,
    assume_expert: tuple[str, ...],
    assume_not_expert: tuple[str, ...],
    as_json: bool,
    quiet: bool,
) -> None:
    """Account for every byte of REPACKED against ORIGINAL; exit 1 naming the first difference."""
    plan = load_plan(plan_path) if plan_path else None
    if plan is not None and plan.model_fingerprint is None:
        warn([shape_only_warning("plan", plan_path, original)])
    result = verify(
        original,
        repacked,
        plan,
        plan_path,
        progress=RichProgress(not quiet and not as_json),
        assume_expert=assume_expert,
        assume_not_expert=assume_not_expert,
    )
    emit(result, as_json, _render_verify)
    if not result.ok:
        d = result.difference
        assert d is not None
        raise VerificationFailed(d.message, d.file)
