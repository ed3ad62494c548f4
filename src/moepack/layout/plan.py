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
from ..safeio import write_bytes_atomic

NATIVE_FORMAT = "moepack-plan"
NATIVE_VERSION = 1


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
def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read a native ``.moeplan`` or a peer ``.pmxplan`` (detected by content)."""
    p = Path(path)
    if not p.is_file():
        raise BadInput("no such plan file", p)
    raw = p.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    stripped = text.lstrip()
    if stripped.startswith("{"):
        return _read_native(text, p)
    first = next(
        (ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")),
        "",
    )
    if first.startswith("pmxplan"):
        return _read_pmxplan(text, p)
    raise BadInput("not a plan (expected moepack JSON or a 'pmxplan 1' text file)", p)


def _read_native(text: str, p: Path) -> Plan:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInput(
            f"plan JSON is corrupt at line {e.lineno} column {e.colno}: {e.msg}", p
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != NATIVE_FORMAT:
        raise BadInput(f"not a moepack plan (format field is not {NATIVE_FORMAT!r})", p)
    if doc.get("version") != NATIVE_VERSION:
        raise BadInput(
            f"unsupported plan version {doc.get('version')!r} (supported: {NATIVE_VERSION})", p
        )
    layers = []
    try:
        for i, lj in enumerate(doc["layers"]):
            raw_perm = lj["perm"]
            if not isinstance(raw_perm, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in raw_perm
            ):
                raise BadInput(f"layer entry {i}: perm must be a list of integers", p)
            perm = np.asarray(raw_perm, dtype=np.int64)
            if not isinstance(lj["block"], int) or isinstance(lj["block"], bool):
                raise BadInput(f"layer entry {i}: block must be an integer", p)
            if "n_expert" in lj and int(lj["n_expert"]) != len(perm):
                raise BadInput(
                    f"layer entry {i}: n_expert {lj['n_expert']} but {len(perm)} perm entries", p
                )
            layers.append(
                LayerPlan(
                    int(lj["block"]),
                    perm,
                    [str(t) for t in lj.get("tensors", [])],
                    lj.get("requests_before"),
                    lj.get("requests_after"),
                    lj.get("speedup"),
                )
            )
        return Plan(
            layers,
            doc.get("model_fingerprint"),
            doc.get("model"),
            doc.get("trace"),
            str(doc.get("source", "")),
            float(doc.get("created", 0.0)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise BadInput(f"plan is malformed ({type(e).__name__}: {e})", p) from None


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
                cur = LayerPlan(int(words[1]), np.zeros(0, dtype=np.int64))
                if len(words) >= 4 and words[2] == "experts":
                    cur.perm = np.full(int(words[3]), -1, dtype=np.int64)
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
                perm = np.asarray(
                    [int(x) for x in s[len("perm") :].strip().split(",") if x], dtype=np.int64
                )
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
