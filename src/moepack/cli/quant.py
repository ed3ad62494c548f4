"""CLI for quantisation: ``compare`` renders the library's per-tensor and per-expert metrics."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from ..errors import VerificationFailed
from ..quant.compare import CompareResult, TensorDiff, Thresholds, compare
from ..quant.engine import DEQUANT_ENGINES
from ..quant.metrics import Metrics
from .options import count_option, input_path, json_option, quiet_option
from .render import RichProgress, emit, human_bytes, put, styled, table

WORST_EXPERTS_SHOWN = 20


def _num(v: float | None, digits: int = 6) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _percent(share: float) -> str:
    """A relative error as a percentage; an absurd one in short scientific form."""
    return f"{100 * share:.3f} %" if share < 1e4 else f"{100 * share:.3g} %"


def _cells(m: Metrics) -> list[str]:
    return [
        f"{m.values:,}",
        f"{m.rmse:.3g}",
        f"{m.max_abs:.3g}",
        "—" if m.rel_error is None else _percent(m.rel_error),
        _num(m.correlation),
        _num(m.cosine),
        "∞" if m.identical else _num(m.snr_db, 2),
        f"{m.nonfinite_ref}/{m.nonfinite_cand}",
    ]


_METRIC_COLUMNS = [
    "values",
    "rmse",
    "max |Δ|",
    "rel. error",
    "corr",
    "cosine",
    "SNR dB",
    "non-finite",
]


def _label(t: TensorDiff) -> str:
    """The tensor, and where a fused file holds it as half of ``ffn_gate_up_exps``."""
    fused = [
        side for side, name in (("ref", t.ref_tensor), ("cand", t.cand_tensor)) if name != t.name
    ]
    return f"{t.name} (fused in {fused[0]})" if fused else t.name


def _render(con: Console, r: CompareResult) -> None:
    rows = [
        [_label(t), f"{t.type_ref}→{t.type_cand}", *_cells(t.metrics), "ok" if t.ok else "FAIL"]
        for t in r.tensors
    ]
    right = set(range(2, 10))
    con.print(table(None, ["tensor", "types", *_METRIC_COLUMNS, "verdict"], rows, right))
    experts = sorted(
        ((t, e) for t in r.tensors for e in t.experts), key=lambda te: te[1].metrics.badness()
    )
    if experts:
        shown = experts[:WORST_EXPERTS_SHOWN]
        rows = [
            [t.name, str(e.expert), f"{e.slot_ref}/{e.slot_cand}", *_cells(e.metrics)]
            for t, e in shown
        ]
        title = f"worst {len(shown)} of {len(experts)} expert slices (--json lists all)"
        con.print(table(title, ["tensor", "expert", "slots", *_METRIC_COLUMNS], rows, right))
    for s in r.skipped:
        con.print(f"skipped {s.name} ({s.type_ref}→{s.type_cand}): {s.reason}")
    engines = sorted({e for t in r.tensors for e in (t.engine_ref, t.engine_cand)})
    con.print(
        f"{len(r.tensors)} tensors, {human_bytes(r.bytes_read)} dequantised in {r.seconds:.2f} s "
        f"(engine {', '.join(engines) or r.engine}); {len(r.skipped)} skipped"
    )
    worst = r.worst
    if r.ok:
        corr = _num(worst.metrics.correlation) if worst else "—"
        put(
            con,
            styled("PASS", "bold green"),
            f" — worst correlation {corr} (threshold {r.thresholds.min_correlation})",
        )
    else:
        failed = [t for t in r.tensors if not t.ok]
        put(
            con,
            styled("FAIL", "bold red"),
            f" — {len(failed)} tensors: {failed[0].name}: {'; '.join(failed[0].failures)}",
        )


@click.command("compare")
@click.argument("reference", type=input_path)
@click.argument("candidate", type=input_path)
@click.option("--tensor", "pattern", help="Only tensors whose name matches this glob.")
@click.option("--per-expert", is_flag=True, help="Metrics per expert slice, ranked worst first.")
@count_option("--limit", None, "Compare at most this many tensors (in file order).")
@click.option(
    "--engine",
    type=click.Choice(DEQUANT_ENGINES.names()),
    default="gguf",
    show_default=True,
    help="Dequantiser: gguf-py's codecs or ggml's own C codecs (from llama-cpp-python).",
)
@click.option(
    "--min-correlation",
    type=click.FloatRange(-1, 1),
    default=0.99,
    show_default=True,
    help="Fail a tensor whose correlation is below this.",
)
@click.option(
    "--max-rel-error",
    type=click.FloatRange(0),
    help="Fail a tensor whose relative error is above this.",
)
@json_option
@quiet_option
def compare_cmd(
    reference: Path,
    candidate: Path,
    pattern: str | None,
    per_expert: bool,
    limit: int | None,
    engine: str,
    min_correlation: float,
    max_rel_error: float | None,
    as_json: bool,
    quiet: bool,
) -> None:
    """Dequantise the tensors of REFERENCE and CANDIDATE (two GGUFs of one model) and measure
    the difference; exit 1 when a tensor fails the thresholds."""
    result = compare(
        reference,
        candidate,
        tensor_pattern=pattern,
        per_expert=per_expert,
        limit=limit,
        engine=engine,
        thresholds=Thresholds(min_correlation, max_rel_error),
        progress=RichProgress(not quiet and not as_json),
    )
    emit(result, as_json, _render)
    if not result.ok:
        bad = next(t for t in result.tensors if not t.ok)
        raise VerificationFailed(f"tensor {bad.name!r}: {'; '.join(bad.failures)}", candidate)
