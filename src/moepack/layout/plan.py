"""``Plan``: per MoE block, new slot -> old expert; bound to the model it was made for.

Two formats: moepack's own (``.moeplan``, versioned JSON carrying the model fingerprint) and the
peer's ``.pmxplan`` text (``pmxplan 1``; no fingerprint, so it binds to nothing and says so).
A plan is checked against a model before anything uses it: every block must be a MoE block,
every permutation a permutation of that block's experts, the fingerprint (when known) equal.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..blocklist import format_index_list
from ..checkpoint.model import MoeModel
from ..errors import BadInput
from ..filekinds import PLAN, check_output_kind
from ..inputs import load_json, read_capped
from ..safeio import write_bytes_atomic
from ..trace.core import MAX_EXPERTS

NATIVE_FORMAT = "moepack-plan"
NATIVE_VERSION = 1
MAX_BLOCK = 1 << 20  # no model has a millionth block; larger numbers are corruption


@dataclass
class LayerPlan:
    """One block's permutation: ``perm[new_slot] = old_expert``, plus optional cost figures."""

    block: int
    perm: np.ndarray
    tensors: list[str] = field(default_factory=list)
    requests_before: float | None = None
    requests_after: float | None = None
    speedup: float | None = None

    @property
    def is_identity(self) -> bool:
        return bool(np.array_equal(self.perm, np.arange(len(self.perm))))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "block": self.block,
            "n_expert": len(self.perm),
            "perm": self.perm.tolist(),
        }
        if self.tensors:
            out["tensors"] = list(self.tensors)
        for k in ("requests_before", "requests_after", "speedup"):
            v = getattr(self, k)
            if v is not None:
                out[k] = v
        return out


@dataclass
class Plan:
    """Permutations for some MoE blocks of one model."""

    layers: list[LayerPlan]
    model_fingerprint: str | None = None
    model: str | None = None
    trace: str | None = None
    source: str = ""
    created: float = field(default_factory=time.time)
    # What tied the trace behind this plan to its model: "fingerprint" (the trace recorded
    # the model's), "shape" (it recorded none: any model of the same shape fits), or None.
    trace_binding: str | None = None

    def perm_for(self, block: int) -> np.ndarray | None:
        for lp in self.layers:
            if lp.block == block:
                return lp.perm
        return None

    def inverse(self) -> Plan:
        """The plan that undoes this one on the repacked model."""
        layers = [
            LayerPlan(lp.block, np.argsort(lp.perm).astype(np.int64), list(lp.tensors))
            for lp in self.layers
        ]
        return Plan(layers, None, self.model, self.trace, f"inverse of {self.source or 'a plan'}")

    def to_json(self) -> dict[str, Any]:
        return {
            "format": NATIVE_FORMAT,
            "version": NATIVE_VERSION,
            "model_fingerprint": self.model_fingerprint,
            "model": self.model,
            "trace": self.trace,
            "source": self.source,
            "created": self.created,
            "trace_binding": self.trace_binding,
            "layers": [lp.to_json() for lp in self.layers],
        }

    # ------------------------------------------------------------------ checks
    def check_against(
        self, model: MoeModel, plan_path: str | os.PathLike[str] | None = None
    ) -> None:
        """Raise ``BadInput`` (naming the plan) unless this plan fits ``model`` exactly."""
        where = plan_path or "plan"
        if self.model_fingerprint and self.model_fingerprint != model.fingerprint:
            raise BadInput(
                f"plan is for another model (fingerprint {self.model_fingerprint}, "
                f"{model.path.name} is {model.fingerprint})",
                where,
            )
        seen: set[int] = set()
        moe = {b.index: b for b in model.blocks}
        for lp in self.layers:
            if lp.block in seen:
                raise BadInput(f"block {lp.block} appears twice", where)
            seen.add(lp.block)
            if lp.block not in moe:
                raise BadInput(
                    f"block {lp.block} is not a MoE block of {model.path.name} "
                    f"(MoE blocks: {format_index_list(moe)})",
                    where,
                )
            block = moe[lp.block]
            if len(lp.perm) != block.n_expert:
                raise BadInput(
                    f"block {lp.block}: permutation has {len(lp.perm)} entries, the model has "
                    f"{block.n_expert} experts",
                    where,
                )
            if not is_permutation(lp.perm):
                raise BadInput(
                    f"block {lp.block}: not a permutation ({_why_not_perm(lp.perm)})", where
                )
            names = {t.name for t in block.tensors}
            unknown = [n for n in lp.tensors if n not in names]
            if unknown:
                raise BadInput(
                    f"block {lp.block}: plan names {unknown[0]!r}, which is not an expert-axis "
                    f"tensor of this block",
                    where,
                )


def is_permutation(perm: np.ndarray) -> bool:
    n = len(perm)
    if n == 0 or perm.min() < 0 or perm.max() >= n:
        return False
    return bool(np.all(np.bincount(perm, minlength=n) == 1))


def _why_not_perm(perm: np.ndarray) -> str:
    n = len(perm)
    bad = perm[(perm < 0) | (perm >= n)]
    if len(bad):
        return f"entry {int(bad[0])} is outside 0..{n - 1}"
    counts = np.bincount(perm, minlength=n)
    return f"expert {int(np.argmax(counts > 1))} appears {int(counts.max())} times"


# ---------------------------------------------------------------------- reading
MAX_PLAN_BYTES = 64 << 20  # a plan lists one permutation per block: a few MiB at most


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read a native ``.moeplan`` or a peer ``.pmxplan`` (detected by content)."""
    p = Path(path)
    raw = read_capped(p, "plan file", MAX_PLAN_BYTES)
    text = raw.decode("utf-8", errors="replace")
    stripped = text.lstrip()
    if stripped.startswith("{"):
        return _read_native(raw, p)
    first = next(
        (ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")),
        "",
    )
    if first.startswith("pmxplan"):
        return _read_pmxplan(text, p)
    raise BadInput("not a plan (expected moepack JSON or a 'pmxplan 1' text file)", p)


def _int_field(value: Any, what: str, p: Path, low: int = 0, high: int = MAX_EXPERTS) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadInput(f"{what} must be an integer from {low} to {high:,}, got {value!r}", p)
    return value


def _opt(value: Any, kind: type | tuple[type, ...], what: str, p: Path) -> Any:
    if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
        raise BadInput(f"{what} has the wrong type: {type(value).__name__}", p)
    return value


def _read_native(raw: bytes, p: Path) -> Plan:
    doc = load_json(raw, p, "plan JSON", allow_nan=True)
    if not isinstance(doc, dict) or doc.get("format") != NATIVE_FORMAT:
        raise BadInput(f"not a moepack plan (format field is not {NATIVE_FORMAT!r})", p)
    if doc.get("version") != NATIVE_VERSION or isinstance(doc.get("version"), bool):
        raise BadInput(
            f"unsupported plan version {doc.get('version')!r} (supported: {NATIVE_VERSION})", p
        )
    raw_layers = doc.get("layers")
    if not isinstance(raw_layers, list):
        raise BadInput("plan field 'layers' must be a list", p)
    layers = []
    for i, lj in enumerate(raw_layers):
        if not isinstance(lj, dict):
            raise BadInput(f"layer entry {i} must be an object", p)
        if "perm" not in lj or "block" not in lj:
            raise BadInput(f"layer entry {i} lacks {'perm' if 'perm' not in lj else 'block'}", p)
        raw_perm = lj["perm"]
        if not isinstance(raw_perm, list) or len(raw_perm) > MAX_EXPERTS:
            raise BadInput(f"layer entry {i}: perm must be a list of at most {MAX_EXPERTS:,}", p)
        for x in raw_perm:
            _int_field(x, f"layer entry {i}: perm entry", p, 0, MAX_EXPERTS - 1)
        perm = np.asarray(raw_perm, dtype=np.int64)
        block = _int_field(lj["block"], f"layer entry {i}: block", p, 0, MAX_BLOCK)
        if "n_expert" in lj and _int_field(lj["n_expert"], f"layer entry {i}: n_expert", p) != len(
            perm
        ):
            raise BadInput(
                f"layer entry {i}: n_expert {lj['n_expert']} but {len(perm)} perm entries", p
            )
        tensors = lj.get("tensors", [])
        if not isinstance(tensors, list) or not all(isinstance(t, str) for t in tensors):
            raise BadInput(f"layer entry {i}: tensors must be a list of names", p)
        figures = [
            _opt(lj.get(k), (int, float), f"layer entry {i}: {k}", p)
            for k in ("requests_before", "requests_after", "speedup")
        ]
        layers.append(LayerPlan(block, perm, list(tensors), *figures))
    created = _opt(doc.get("created", 0.0), (int, float), "plan field 'created'", p)
    binding = _opt(doc.get("trace_binding"), str, "plan field 'trace_binding'", p)
    return Plan(
        layers,
        _opt(doc.get("model_fingerprint"), str, "plan field 'model_fingerprint'", p),
        _opt(doc.get("model"), str, "plan field 'model'", p),
        _opt(doc.get("trace"), str, "plan field 'trace'", p),
        str(_opt(doc.get("source", ""), str, "plan field 'source'", p) or ""),
        float(created or 0.0),
        trace_binding=binding,
    )


def _read_pmxplan(text: str, p: Path) -> Plan:
    layers: list[LayerPlan] = []
    model = trace = None
    cur: LayerPlan | None = None
    header_seen = False
    for lineno, line in enumerate(text.splitlines(), 1):
        s = line.split("#", 1)[0].strip()
        if not s:
            continue
        words = s.split()
        try:
            if not header_seen:
                if words != ["pmxplan", "1"]:
                    raise BadInput(f"line {lineno}: expected 'pmxplan 1', got {s!r}", p)
                header_seen = True
            elif words[0] == "model":
                model = s[len("model") :].strip()
            elif words[0] == "trace":
                trace = s[len("trace") :].strip()
            elif words[0] == "layer":
                block = _int_field(int(words[1]), f"line {lineno}: layer", p, 0, MAX_BLOCK)
                cur = LayerPlan(block, np.zeros(0, dtype=np.int64))
                if len(words) >= 4 and words[2] == "experts":
                    n = _int_field(int(words[3]), f"line {lineno}: experts", p, 1)
                    cur.perm = np.full(n, -1, dtype=np.int64)
                if "speedup" in words:
                    cur.speedup = float(words[words.index("speedup") + 1])
                if "requests" in words:
                    i = words.index("requests")
                    cur.requests_before = float(words[i + 1])
                    cur.requests_after = float(words[i + 3])
                layers.append(cur)
            elif words[0] == "tensors":
                if cur is None:
                    raise BadInput(f"line {lineno}: 'tensors' before any 'layer'", p)
                cur.tensors = [t for t in s[len("tensors") :].strip().split(",") if t]
            elif words[0] == "perm":
                if cur is None:
                    raise BadInput(f"line {lineno}: 'perm' before any 'layer'", p)
                entries = [int(x) for x in s[len("perm") :].strip().split(",") if x]
                if len(entries) > MAX_EXPERTS or any(not 0 <= x < MAX_EXPERTS for x in entries):
                    raise BadInput(
                        f"line {lineno}: perm entries must be 0 to {MAX_EXPERTS - 1:,}, at most "
                        f"{MAX_EXPERTS:,} of them",
                        p,
                    )
                perm = np.asarray(entries, dtype=np.int64)
                if len(cur.perm) and len(cur.perm) != len(perm):
                    raise BadInput(
                        f"line {lineno}: layer {cur.block} says {len(cur.perm)} experts but its perm has {len(perm)}",
                        p,
                    )
                cur.perm = perm
            else:
                raise BadInput(f"line {lineno}: unknown keyword {words[0]!r}", p)
        except (ValueError, IndexError):
            raise BadInput(f"line {lineno}: malformed {words[0]!r} line: {s!r}", p) from None
    if not header_seen:
        raise BadInput("empty plan", p)
    for lp in layers:
        if len(lp.perm) == 0 or (lp.perm < 0).all():
            raise BadInput(f"layer {lp.block} has no perm line", p)
    return Plan(layers, None, model, trace, "pmxplan")


# ---------------------------------------------------------------------- writing
def save_plan(
    plan: Plan, path: str | os.PathLike[str], fmt: str | None = None, inputs: tuple[Path, ...] = ()
) -> Path:
    """Write ``plan`` as ``native`` (default; ``.moeplan``) or ``pmxplan`` (by name or ``.pmxplan``)."""
    return write_bytes_atomic(path, encode_plan(plan, path, fmt), inputs)


def encode_plan(plan: Plan, path: str | os.PathLike[str], fmt: str | None = None) -> bytes:
    """The bytes ``save_plan`` writes (format by name, else by the extension of ``path``)."""
    check_output_kind(path, PLAN)
    fmt = fmt or ("pmxplan" if Path(path).suffix == ".pmxplan" else "native")
    if fmt == "native":
        return (json.dumps(plan.to_json(), indent=1) + "\n").encode()
    if fmt == "pmxplan":
        return _pmxplan_text(plan).encode()
    raise BadInput(f"unknown plan format {fmt!r} (native, pmxplan)")


def _pmxplan_text(plan: Plan) -> str:
    lines = [
        "pmxplan 1",
        "# written by moepack"
        + (f"; model fingerprint {plan.model_fingerprint}" if plan.model_fingerprint else ""),
    ]
    if plan.model:
        lines.append(f"model {plan.model}")
    if plan.trace:
        lines.append(f"trace {plan.trace}")
    for lp in plan.layers:
        before = lp.requests_before if lp.requests_before is not None else 0.0
        after = lp.requests_after if lp.requests_after is not None else 0.0
        speed = lp.speedup if lp.speedup is not None else 1.0
        lines.append(
            f"layer {lp.block} experts {len(lp.perm)} speedup {speed:.4f} requests {before:.2f} -> {after:.2f}"
        )
        if lp.tensors:
            lines.append("tensors " + ",".join(lp.tensors))
        lines.append("perm " + ",".join(str(int(x)) for x in lp.perm))
    return "\n".join(lines) + "\n"
