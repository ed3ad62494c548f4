"""Per-expert precision plans: hot experts keep more bits, cold ones fewer, under a byte budget.

A plan gives each routed expert of each MoE block a target type from a ladder (``Q8_0``,
``Q6_K``, ``Q5_K``, ``Q4_K``, ``Q3_K`` by default) or ``source`` (its bytes unchanged). A part
is never given more bits than its source type has (that would spend bytes and recover no
precision), nor a type whose blocks do not divide its rows: such a part keeps its source type.
Routers, norms and shared experts are not in a store and are never touched.

Choosing: every expert starts at the cheapest level; upgrades are taken greedily by the
expected error they remove per byte, ``(count + ½) × (2^(−2·b₀) − 2^(−2·b₁))`` for a move from
``b₀`` to ``b₁`` bits per weight (quantisation noise power falls by 4× per bit), while the
stored bytes stay within the budget. ``count`` is how often the trace routed to the expert; the
½ keeps experts the trace never saw from being starved when bytes remain.

The file (``.moeprec``, JSON, ``moepack-precision`` version 1) is documented in docs/store.md.
"""

from __future__ import annotations

import heapq
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ..binding import basis, shape_only_warning
from ..checkpoint.model import MoeModel
from ..errors import BadInput
from ..filekinds import PRECISION, check_output_kind
from ..inputs import load_json, read_capped
from ..safeio import check_destination, write_bytes_atomic
from ..trace.core import RoutingTrace
from ..trace.stats import expert_counts
from .index import part_bytes
from .placement import part_order, slice_shape

FORMAT = "moepack-precision"
VERSION = 1
SOURCE = "source"
DEFAULT_LADDER = ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K")
MAX_PLAN_BYTES = 64 << 20
PRIOR = 0.5


def bits_per_weight(qtype: int) -> float:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    return size * 8 / block


def type_named(name: str, where: str | os.PathLike[str] | None = None) -> GGMLQuantizationType:
    """The ggml type called ``name`` (``Q4_K``, case-insensitive); ``BadInput`` otherwise."""
    try:
        return GGMLQuantizationType[name.upper()]
    except KeyError:
        raise BadInput(f"unknown quantisation type {name!r}", where) from None


def part_type(target: int | None, source_type: int, shape: tuple[int, ...]) -> int:
    """The type a part of ``shape`` is stored as when its expert's target is ``target``: the
    target when the part is a matrix, the target has fewer bits than the source and its
    blocks fit the rows; else the source type."""
    if target is None or len(shape) < 2:  # biases and other vectors keep their type
        return source_type
    if bits_per_weight(target) >= bits_per_weight(source_type):
        return source_type
    return target if part_bytes(target, shape) is not None else source_type


@dataclass
class PrecisionPlan:
    """Target types per block and expert (``None``: the source's), bound to one model."""

    model_fingerprint: str
    budget_bytes: int
    blocks: dict[int, list[int | None]]
    ladder: list[str] = field(default_factory=lambda: list(DEFAULT_LADDER))
    counts: dict[int, list[int]] = field(default_factory=dict)
    source_bytes: int = 0
    planned_bytes: int = 0
    model: str | None = None
    trace: str | None = None
    trace_binding: str | None = None
    phase: str = "all"
    created: float = field(default_factory=time.time)
    path: Path | None = None

    def target(self, block: int, expert: int) -> int | None:
        row = self.blocks.get(block)
        return row[expert] if row is not None and expert < len(row) else None

    def stored_bytes(self, model: MoeModel) -> tuple[int, int]:
        """(bytes at the source types, bytes as planned) of every routed expert's parts."""
        source = planned = 0
        for block in model.blocks:
            tensors = part_order(block)
            for e in range(block.n_expert):
                t = self.target(block.index, e)
                for tensor in tensors:
                    shape = slice_shape(tensor)
                    src = int(tensor.entry.ggml_type)
                    source += tensor.slice_bytes
                    planned += part_bytes(part_type(t, src, shape), shape) or 0
        return source, planned

    def check_against(self, model: MoeModel) -> None:
        """``BadInput`` unless this plan is for ``model`` and its types fit its budget."""
        where = self.path
        if self.model_fingerprint != model.fingerprint:
            raise BadInput(
                f"precision plan is for the model with fingerprint {self.model_fingerprint}, "
                f"but {model.path} has fingerprint {model.fingerprint}",
                where,
            )
        moe = {b.index: b.n_expert for b in model.blocks}
        for b, row in self.blocks.items():
            if b not in moe:
                raise BadInput(f"precision plan names block {b}, not a MoE block", where)
            if len(row) != moe[b]:
                raise BadInput(
                    f"precision plan gives block {b} {len(row)} experts; it has {moe[b]}", where
                )
        _, planned = self.stored_bytes(model)
        if planned > self.budget_bytes:
            raise BadInput(
                f"precision plan is over budget: its types store {planned:,} bytes of experts, "
                f"its budget is {self.budget_bytes:,}",
                where,
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model_fingerprint": self.model_fingerprint,
            "model": self.model,
            "trace": self.trace,
            "trace_binding": self.trace_binding,
            "phase": self.phase,
            "created": self.created,
            "budget_bytes": self.budget_bytes,
            "source_bytes": self.source_bytes,
            "planned_bytes": self.planned_bytes,
            "ladder": self.ladder,
            "blocks": [
                {
                    "block": b,
                    "types": [SOURCE if t is None else GGMLQuantizationType(t).name for t in row],
                    "counts": self.counts.get(b, []),
                }
                for b, row in sorted(self.blocks.items())
            ],
        }


@dataclass
class PrecisionPlanResult:
    """A plan made from a trace, and what it does."""

    plan: PrecisionPlan
    out: Path | None
    experts_per_type: dict[str, int]
    requantised: int
    bytes_saved: int
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "out": str(self.out) if self.out else None,
            "budget_bytes": self.plan.budget_bytes,
            "source_bytes": self.plan.source_bytes,
            "planned_bytes": self.plan.planned_bytes,
            "bytes_saved": self.bytes_saved,
            "requantised": self.requantised,
            "experts_per_type": self.experts_per_type,
            "ladder": self.plan.ladder,
            "notes": self.notes,
            "warnings": self.warnings,
        }


@dataclass(frozen=True)
class _Expert:
    block: int
    expert: int
    count: int
    levels: list[tuple[int | None, int, float]]  # (target, bytes, noise), cheapest first


def _levels(
    model: MoeModel, block_index: int, ladder: list[GGMLQuantizationType]
) -> list[tuple[int | None, int, float]]:
    """The distinct (target, bytes, noise) choices for one expert of a block, cheapest first."""
    tensors = part_order(model.block(block_index))
    out: dict[int, tuple[int | None, int, float]] = {}
    for target in [None, *(int(t) for t in ladder)]:
        size, noise, values = 0, 0.0, 0
        for tensor in tensors:
            shape = slice_shape(tensor)
            gt = part_type(target, int(tensor.entry.ggml_type), shape)
            n = int(np.prod(shape))
            size += part_bytes(gt, shape) or 0
            noise += n * 2.0 ** (-2 * bits_per_weight(gt))
            values += n
        out.setdefault(size, (target, size, noise / max(values, 1)))
    kept: list[tuple[int | None, int, float]] = []
    for lv in sorted(out.values(), key=lambda lv: lv[1]):
        if not kept or lv[2] < kept[-1][2]:  # a dearer level must also be more precise
            kept.append(lv)
    return kept


def make_precision_plan(
    model: MoeModel,
    trace: RoutingTrace,
    budget_bytes: int | None = None,
    budget_fraction: float | None = None,
    ladder: list[str] | None = None,
    phase: str = "all",
) -> PrecisionPlan:
    """A plan for ``model`` from ``trace``'s per-expert counts (see the module docstring)."""
    if (budget_bytes is None) == (budget_fraction is None):
        raise BadInput("give exactly one budget: bytes or a fraction of the experts' bytes")
    types = [type_named(n) for n in (ladder or list(DEFAULT_LADDER))]
    if not types:
        raise BadInput("the precision ladder names no types")
    blocks_of_trace = trace.check_against(model)
    counts = np.asarray(expert_counts(trace, phase))
    per_block: dict[int, np.ndarray] = {}
    for layer, b in enumerate(blocks_of_trace):
        per_block[b] = counts[layer, : model.block(b).n_expert].astype(np.int64)
    experts: list[_Expert] = []
    for block in model.blocks:
        levels = _levels(model, block.index, types)
        row = per_block.get(block.index, np.zeros(block.n_expert, np.int64))
        experts += [_Expert(block.index, e, int(row[e]), levels) for e in range(block.n_expert)]
    source = sum(t.entry.n_bytes for b in model.blocks for t in b.weight_tensors)
    budget = budget_bytes if budget_bytes is not None else int((budget_fraction or 0) * source)
    floor = sum(x.levels[0][1] for x in experts)
    if budget < floor:
        cheapest = types[-1].name if len(types) else "?"
        raise BadInput(
            f"a budget of {budget:,} bytes is below the smallest store this ladder allows: "
            f"{floor:,} bytes (every expert at its cheapest level, down to {cheapest})"
        )
    level = [0] * len(experts)
    spent = floor
    heap: list[tuple[float, int]] = []

    def push(i: int) -> None:
        x = experts[i]
        lv = level[i]
        if lv + 1 < len(x.levels):
            _, b0, n0 = x.levels[lv]
            _, b1, n1 = x.levels[lv + 1]
            gain = (x.count + PRIOR) * (n0 - n1) / max(b1 - b0, 1)
            heapq.heappush(heap, (-gain, i))

    for i in range(len(experts)):
        push(i)
    while heap:
        _, i = heapq.heappop(heap)
        x = experts[i]
        extra = x.levels[level[i] + 1][1] - x.levels[level[i]][1]
        if spent + extra > budget:
            continue  # this step does not fit; cheaper steps of other experts may
        level[i] += 1
        spent += extra
        push(i)
    chosen: dict[int, list[int | None]] = {b.index: [None] * b.n_expert for b in model.blocks}
    for i, x in enumerate(experts):
        chosen[x.block][x.expert] = x.levels[level[i]][0]
    plan = PrecisionPlan(
        model_fingerprint=model.fingerprint,
        budget_bytes=budget,
        blocks=chosen,
        ladder=[t.name for t in types],
        counts={b: row.tolist() for b, row in per_block.items()},
        model=str(model.path),
        trace=str(trace.path) if trace.path else None,
        trace_binding=basis(trace.model_fingerprint),
        phase=phase,
    )
    plan.source_bytes, plan.planned_bytes = plan.stored_bytes(model)
    return plan


def summarise(plan: PrecisionPlan, out: Path | None) -> PrecisionPlanResult:
    """How many experts each type got, and the bytes saved against the source types."""
    per_type: dict[str, int] = {}
    requantised = 0
    for row in plan.blocks.values():
        for t in row:
            name = SOURCE if t is None else GGMLQuantizationType(t).name
            per_type[name] = per_type.get(name, 0) + 1
            requantised += t is not None
    notes = []
    missing = [b for b in plan.blocks if b not in plan.counts]
    if missing:
        notes.append(f"the trace does not cover blocks {missing}: their experts count as unseen")
    return PrecisionPlanResult(
        plan, out, per_type, requantised, plan.source_bytes - plan.planned_bytes, notes
    )


def write_precision_plan(
    model_path: str | os.PathLike[str],
    trace_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    budget_bytes: int | None = None,
    budget_fraction: float | None = None,
    ladder: list[str] | None = None,
    phase: str = "all",
    n_expert: int | None = None,
    block_map: list[int] | None = None,
) -> PrecisionPlanResult:
    """Plan ``model_path``'s per-expert precision from ``trace_path`` and write it to ``out``
    (checked before any planning)."""
    from ..trace.formats import load_trace

    check_destination(check_output_kind(out, PRECISION), [model_path, trace_path])
    with MoeModel(model_path) as model:
        trace = load_trace(trace_path, n_expert=n_expert, model=model, check=False)
        if block_map is not None:
            trace = trace.replace(block_map=block_map)
        plan = make_precision_plan(model, trace, budget_bytes, budget_fraction, ladder, phase)
        plan.model, plan.trace = str(model_path), str(trace_path)
        written = save_precision_plan(plan, out)
        result = summarise(plan, written)
        if trace.model_fingerprint is None:
            result.warnings.append(shape_only_warning("trace", trace_path, model.path))
        return result


def save_precision_plan(plan: PrecisionPlan, out: str | os.PathLike[str]) -> Path:
    """Write ``plan`` to ``out`` (``.moeprec``) atomically."""
    dest = check_output_kind(out, PRECISION)
    inputs = [Path(plan.model)] if plan.model else []
    if plan.trace:
        inputs.append(Path(plan.trace))
    data = (json.dumps(plan.to_json(), indent=1) + "\n").encode()
    return write_bytes_atomic(dest, data, inputs)


def load_precision_plan(path: str | os.PathLike[str]) -> PrecisionPlan:
    """Read a ``.moeprec`` file; ``BadInput`` naming the file and field on anything wrong."""
    p = Path(path)
    doc = load_json(read_capped(p, "precision plan", MAX_PLAN_BYTES), p, "precision plan")

    def fail(message: str) -> BadInput:
        return BadInput(f"precision plan: {message}", p)

    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise fail(f"not a {FORMAT} document")
    if doc.get("version") != VERSION:
        raise fail(f"version {doc.get('version')!r} is not {VERSION}")
    fp = doc.get("model_fingerprint")
    budget = doc.get("budget_bytes")
    if not isinstance(fp, str) or not fp:
        raise fail("model_fingerprint is missing")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise fail("budget_bytes is not a byte count")
    blocks_doc = doc.get("blocks")
    if not isinstance(blocks_doc, list):
        raise fail("blocks is not a list")
    blocks: dict[int, list[int | None]] = {}
    counts: dict[int, list[int]] = {}
    for i, bd in enumerate(blocks_doc):
        if not isinstance(bd, dict):
            raise fail(f"blocks[{i}] is not an object")
        b = bd.get("block")
        names = bd.get("types")
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise fail(f"blocks[{i}].block is not a block index")
        if b in blocks:
            raise fail(f"block {b} appears twice")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise fail(f"block {b}: types is not a list of type names")
        blocks[b] = [None if n == SOURCE else int(type_named(n, p)) for n in names]
        c = bd.get("counts", [])
        if isinstance(c, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in c):
            counts[b] = list(c)
    ladder = doc.get("ladder", [])
    return PrecisionPlan(
        model_fingerprint=fp,
        budget_bytes=budget,
        blocks=blocks,
        ladder=[str(x) for x in ladder] if isinstance(ladder, list) else [],
        counts=counts,
        source_bytes=_int(doc.get("source_bytes")),
        planned_bytes=_int(doc.get("planned_bytes")),
        model=doc.get("model") if isinstance(doc.get("model"), str) else None,
        trace=doc.get("trace") if isinstance(doc.get("trace"), str) else None,
        trace_binding=doc.get("trace_binding")
        if isinstance(doc.get("trace_binding"), str)
        else None,
        phase=str(doc.get("phase", "all")),
        path=p,
    )


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0
