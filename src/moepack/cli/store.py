"""CLI for expert stores: ``store build``, ``store verify``, ``store precision`` and
``store info`` render the library's results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.console import Console

from ..errors import VerificationFailed
from ..layout.plan import load_plan
from ..storage.units import parse_size
from ..store.build import DEFAULT_ALIGNMENT, BuildResult, build_store
from ..store.info import StoreInfo, store_info
from ..store.precision_apply import PlanRequantiser
from ..store.precision_plan import (
    DEFAULT_LADDER,
    PrecisionPlanResult,
    load_precision_plan,
    write_precision_plan,
)
from ..store.verify import StoreVerifyResult, verify_store
from .options import (
    ListType,
    assume_options,
    block_map_option,
    force_option,
    input_path,
    json_option,
    n_expert_option,
    out_option,
    quiet_option,
)
from .render import RichProgress, emit, human_bytes, put, styled, table, warn

WORST_SHOWN = 10


# ------------------------------------------------------------------ build
def _render_build(con: Console, r: BuildResult) -> None:
    con.print(f"wrote {r.out}")
    con.print(
        f"{r.experts} experts of {len(r.blocks)} MoE blocks ({r.layout}, records aligned to "
        f"{r.alignment:,} B): {human_bytes(r.payload_bytes)} of expert bytes, "
        f"{human_bytes(r.padding_bytes)} of padding and index, in {r.seconds:.2f} s"
    )
    p = r.precision
    if not p:
        return
    con.print(
        f"precision plan: {p['requantised']} experts requantised "
        f"({', '.join(f'{t} by {q}' for t, q in p['quantisers'].items()) or 'none'}); "
        f"{human_bytes(p['bytes_saved'])} saved against the source types"
    )
    worst = sorted(p["experts"], key=_badness)[:WORST_SHOWN]
    if worst:
        rows = [
            [
                e["block"],
                e["expert"],
                e["type"],
                e["count"] if e["count"] is not None else "—",
                _num(e["metrics"]["correlation"]),
                _pct(e["metrics"]["rel_error"]),
                f"{e['metrics']['rmse']:.3g}",
            ]
            for e in worst
        ]
        title = f"largest errors, {len(worst)} of {len(p['experts'])} experts (--json lists all)"
        cols = ["block", "expert", "type", "routed", "corr", "rel. error", "rmse"]
        con.print(table(title, cols, rows, {0, 1, 3, 4, 5, 6}))


def _badness(e: dict[str, Any]) -> tuple[float, float]:
    m = e["metrics"]
    corr = m["correlation"] if m["correlation"] is not None else -2.0
    return (corr, -(m["rel_error"] or 0.0))


def _num(v: float | None) -> str:
    return "—" if v is None else f"{v:.6f}"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.3f} %"


@click.command("build")
@click.argument("model", type=input_path)
@out_option("Store to write (.moestore).")
@click.option("--plan", "plan_path", type=input_path, help="Expert order (.moeplan or .pmxplan).")
@click.option(
    "--precision",
    "precision_path",
    type=input_path,
    help="Per-expert precision plan (.moeprec, from `moepack store precision`).",
)
@click.option(
    "--alignment",
    type=int,
    default=DEFAULT_ALIGNMENT,
    show_default=True,
    help="Record alignment in bytes (a power of two, at least 4096: O_DIRECT-safe).",
)
@assume_options
@json_option
@quiet_option
@force_option
def build_cmd(
    model: Path,
    out: Path,
    plan_path: Path | None,
    precision_path: Path | None,
    alignment: int,
    assume_expert: tuple[str, ...],
    assume_not_expert: tuple[str, ...],
    as_json: bool,
    quiet: bool,
) -> None:
    """Write MODEL's routed experts as an expert-major store (dense tensors, routers and
    shared experts stay in MODEL)."""
    plan = load_plan(plan_path) if plan_path is not None else None
    precision = load_precision_plan(precision_path) if precision_path is not None else None
    result = build_store(
        model,
        out,
        plan=plan,
        plan_path=plan_path,
        requantiser=PlanRequantiser(precision) if precision is not None else None,
        alignment=alignment,
        progress=RichProgress(not quiet and not as_json),
        assume_expert=assume_expert,
        assume_not_expert=assume_not_expert,
    )
    warn(result.warnings)
    emit(result, as_json, _render_build)


# ------------------------------------------------------------------ verify
def _render_verify(con: Console, r: StoreVerifyResult) -> None:
    con.print(
        f"{r.records} records, {r.parts_verbatim} parts compared with the model byte for byte, "
        f"{r.parts_requantised} with their requantisation; {human_bytes(r.bytes_compared)} "
        f"in {r.seconds:.2f} s; {r.checksum_failures} checksum failures"
    )
    if r.ok:
        put(con, styled("OK", "bold green"), " — every slice is what the model says it is.")
        return
    rows = [
        [d.block, d.expert, d.slot, d.part, f"{d.store_offset:,}", "ok" if d.checksum_ok else "BAD"]
        for d in r.differences
    ]
    title = f"{r.differences_total} wrong slices" + (
        f" (first {len(r.differences)} listed)" if r.differences_total > len(r.differences) else ""
    )
    cols = ["block", "expert", "slot", "part", "store offset", "checksum"]
    con.print(table(title, cols, rows, {0, 1, 2, 4}))
    first = r.first
    assert first is not None
    put(con, styled("VERIFICATION FAILED", "bold red"), f" — {r.store}: {first.message}")


@click.command("verify")
@click.argument("store", type=input_path)
@click.argument("model", type=input_path)
@json_option
@quiet_option
def verify_cmd(store: Path, model: Path, as_json: bool, quiet: bool) -> None:
    """Check every slice of STORE against MODEL and every record's checksum; exit 1 naming
    the first wrong slice."""
    result = verify_store(store, model, progress=RichProgress(not quiet and not as_json))
    emit(result, as_json, _render_verify)
    if not result.ok:
        first = result.first
        assert first is not None
        raise VerificationFailed(first.message, result.store)


# ------------------------------------------------------------------ precision
class BudgetType(click.ParamType):
    """A byte budget: a size (``12G``, ``800M``) or a share of the experts' bytes (``60%``)."""

    name = "SIZE|N%"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[int | None, float | None]:
        if isinstance(value, tuple):
            return value
        text = str(value).strip()
        if text.endswith("%"):
            try:
                share = float(text[:-1]) / 100
            except ValueError:
                self.fail(f"not a percentage: {text!r}", param, ctx)
            if not 0 < share <= 1:
                self.fail(f"a share must be above 0 % and at most 100 %, got {text}", param, ctx)
            return None, share
        try:
            return parse_size(text), None
        except Exception as e:
            self.fail(str(e), param, ctx)


def _render_precision(con: Console, r: PrecisionPlanResult) -> None:
    plan = r.plan
    con.print(f"wrote {r.out}")
    con.print(
        f"budget {human_bytes(plan.budget_bytes)}: experts stored in "
        f"{human_bytes(plan.planned_bytes)} instead of {human_bytes(plan.source_bytes)} "
        f"({human_bytes(r.bytes_saved)} saved); {r.requantised} experts requantised"
    )
    rows = [[t, n] for t, n in sorted(r.experts_per_type.items())]
    con.print(table("experts per type", ["type", "experts"], rows, {1}))
    for n in r.notes:
        con.print(n)


@click.command("precision")
@click.argument("model", type=input_path)
@click.option("--trace", "trace_path", required=True, type=input_path, help="Routing trace.")
@click.option(
    "--budget",
    required=True,
    type=BudgetType(),
    help="Bytes the experts may take in the store: a size (12G) or a share of today's (60%).",
)
@click.option(
    "--types",
    "ladder",
    type=ListType("str"),
    default=",".join(DEFAULT_LADDER),
    show_default=True,
    help="Types offered, most bits first (never more bits than a part's source type).",
)
@click.option(
    "--phase", type=click.Choice(["all", "prefill", "decode"]), default="all", show_default=True
)
@out_option("Precision plan to write (.moeprec).")
@n_expert_option("Expert count for text traces that lack one.")
@block_map_option
@json_option
@force_option
def precision_cmd(
    model: Path,
    trace_path: Path,
    budget: tuple[int | None, float | None],
    ladder: list[str],
    phase: str,
    out: Path,
    n_expert: int | None,
    block_map: list[int] | None,
    as_json: bool,
) -> None:
    """Give MODEL's hot experts more bits and cold ones fewer, under a byte budget, from
    TRACE's per-expert counts."""
    result = write_precision_plan(
        model,
        trace_path,
        out,
        budget_bytes=budget[0],
        budget_fraction=budget[1],
        ladder=list(ladder),
        phase=phase,
        n_expert=n_expert,
        block_map=block_map,
    )
    warn(result.warnings)
    emit(result, as_json, _render_precision)


# ------------------------------------------------------------------ info
def _render_info(con: Console, r: StoreInfo) -> None:
    con.print(
        f"{r.path}: expert store v{r.version} of {r.model} ({r.architecture}), fingerprint "
        f"{r.fingerprint}; {r.layout}, records aligned to {r.alignment:,} B"
    )
    rows = [
        [
            b["block"],
            b["n_expert"],
            " ".join(b["parts"]),
            ", ".join(f"{t}×{n}" for t, n in b["types"].items()),
            human_bytes(b["record_bytes"]),
        ]
        for b in r.blocks
    ]
    con.print(table(None, ["block", "experts", "parts", "types", "bytes"], rows, {0, 1, 4}))
    con.print(
        f"{human_bytes(r.payload_bytes)} of expert bytes in {human_bytes(r.file_bytes)}; "
        f"precision plan: {'yes' if r.precision else 'none'}"
    )


@click.command("info")
@click.argument("store", type=input_path)
@json_option
def info_cmd(store: Path, as_json: bool) -> None:
    """What STORE holds: its model, blocks, parts and types, per block."""
    emit(store_info(store), as_json, _render_info)
