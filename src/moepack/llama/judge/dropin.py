"""``check-dropin``: the evidence that a rewritten GGUF computes what the original did.

Four gates, each reported with its numbers; the verdict is PASS only when all four pass:

1. **bytes** — ``verify`` accounts for every byte of CANDIDATE against ORIGINAL;
2. **control** — two runs of ORIGINAL in two processes give bit-identical logits and routing,
   so any difference below is the rewrite's, not the engine's;
3. **routing** — CANDIDATE's expert ids, mapped back through the permutation the bytes gate
   found (``VerifyResult.permutations``: recorded in the file, or discovered from the slices
   of a file that records none, as ``repack --keep-header`` writes), are ORIGINAL's on 100 %
   of (token, layer) of the MoE blocks llama.cpp runs, as sets and in router order — order
   judged only between experts whose ORIGINAL weights differ by more than the near-tie
   tolerance (``order_tolerance``), and a set only where more changed than the last expert
   traded for one of a weight within that tolerance (a selection near-tie);
4. **output** — the mean KL divergence between the two files' next-token distributions over
   the text is within two changes measured in this run on the same tokens (no constant),
   added as distances: the KL between two settings of the same engine on ORIGINAL (F32 vs
   F16 KV cache), and the KL that moving ORIGINAL's experts alone makes (the position
   control, ``position``); perplexities of the runs side by side.

The tolerances are measured, not chosen: the F16-KV run is ORIGINAL under a setting of
llama.cpp nobody calls a different model, and the position control is ORIGINAL with its
experts reordered (every byte moved with its expert, routing mapped back), so what either
changes is the size of a change that is no change. The second is there because an expert's
position enters llama.cpp's arithmetic: the router softmax sums its exponentials in expert
order (``position`` says where), and the F16 KV cache alone under-measures that on a model
whose cache is in few layers (qwen3next / qwen35moe: every fourth). Together they bound the
output (``combined_envelope``); the largest change of any router weight between ORIGINAL and
each run (on the cells where both route the same experts), added, is how far a weight may
move, so two experts whose weights lie within twice that of each other may trade places in
router order without a routing change (a near-tie: the order of the top-k only sets the order
of a sum). The control runs say the
engine itself is deterministic, so that nothing else moves.

Every llama.cpp run is a child process (``dropin_worker``) that spools logits and routing to
files in a temporary folder; the comparisons read them through memory maps in chunks. A
multi-token-prediction block (``checkpoint.nextn``) never runs: its bytes are the bytes gate's,
and it is no routing layer.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ...checkpoint.model import MoeModel
from ...checkpoint.provenance import read_provenance
from ...errors import BadInput, MoepackError
from ...progress import NULL_PROGRESS, ProgressSink
from ...rewrite.verify import VerifyResult, verify
from ...trace.core import id_dtype_for
from ..protocol.child import run_worker, scratch_folder
from ..runtime.capture import ModelFacts, model_facts
from .position import PositionControl, write_position_control

TEXT_MODULES = ("json", "argparse", "collections", "pathlib", "subprocess", "logging", "csv")
CHUNK_ROWS = 256


def default_text() -> str:
    """English prose every Python install carries: standard-library module documentation."""
    import importlib

    parts = []
    for name in TEXT_MODULES:
        mod = importlib.import_module(name)
        parts.append(inspect.getdoc(mod) or "")
        for _, obj in sorted(vars(mod).items()):
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__doc__:
                parts.append(inspect.getdoc(obj) or "")
    return "\n\n".join(p for p in parts if p)


@dataclass
class Gate:
    name: str
    ok: bool
    summary: str
    numbers: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"gate": self.name, "ok": self.ok, "summary": self.summary, **self.numbers}


@dataclass
class DropinResult:
    original: Path
    candidate: Path
    tokens: int
    gates: list[Gate]
    start_token: int | None = None  # what llama.cpp puts first in every window (None: nothing)

    @property
    def ok(self) -> bool:
        return all(g.ok for g in self.gates)

    def failure(self) -> str:
        """One line naming each failed gate with its evidence (empty when all passed)."""
        failed = [g for g in self.gates if not g.ok]
        if not failed:
            return ""
        return "not a drop-in: " + "; ".join(
            f"the {g.name} gate failed ({g.summary})" for g in failed
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "original": str(self.original),
            "candidate": str(self.candidate),
            "tokens": self.tokens,
            "start_token": self.start_token,
            "verdict": "PASS" if self.ok else "FAIL",
            "gates": [g.to_json() for g in self.gates],
        }


@dataclass
class DropinRun:
    """One child run's spooled outputs, memory-mapped."""

    tokens: np.ndarray
    ids: np.ndarray  # [tokens, layers, k] in router order
    weights: np.ndarray  # [tokens, layers, k] the router weight of each id
    logits: np.ndarray
    windows: list[int]
    start_token: int | None = None


def _run(
    model: Path,
    facts: ModelFacts,
    folder: Path,
    text: str,
    n_tokens: int,
    kv: str,
    opts: dict,
    label: str,
) -> DropinRun:
    folder.mkdir()
    job = {
        "label": label,
        "model": str(model),
        "out": str(folder),
        "blocks": facts.blocks,
        "k": facts.k,
        "id_dtype": id_dtype_for(facts.n_expert).name,
        "text": text,
        "n_tokens": n_tokens,
        "kv_type": kv,
        **opts,
    }
    done = run_worker("moepack.llama.judge.dropin_worker", job, folder=folder, model=model).done
    n, vocab = int(done["tokens"]), int(done["vocab"])
    shape = (n, len(facts.blocks), facts.k)
    return DropinRun(
        tokens=np.fromfile(folder / "tokens.bin", dtype="<i4"),
        ids=np.memmap(
            folder / "ids.bin", dtype=id_dtype_for(facts.n_expert), mode="r", shape=shape
        ),
        weights=np.memmap(folder / "weights.bin", dtype="<f4", mode="r", shape=shape),
        logits=np.memmap(folder / "logits.bin", dtype="<f4", mode="r", shape=(n, vocab)),
        windows=list(done["windows"]),
        start_token=done.get("start_token"),
    )


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def mean_kl(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over rows of KL(softmax(a) || softmax(b)), in bounded chunks."""
    total = 0.0
    for s in range(0, a.shape[0], CHUNK_ROWS):
        la, lb = (
            _log_softmax(np.asarray(a[s : s + CHUNK_ROWS])),
            _log_softmax(np.asarray(b[s : s + CHUNK_ROWS])),
        )
        total += float(np.sum(np.exp(la) * (la - lb)))
    return total / a.shape[0]


def perplexity(run: DropinRun) -> float:
    """exp(mean NLL of each window's next token), windows as the run cut them."""
    nll, count, start = 0.0, 0, 0
    for w in run.windows:
        logp = _log_softmax(np.asarray(run.logits[start : start + w - 1]))
        nxt = run.tokens[start + 1 : start + w]
        nll -= float(logp[np.arange(w - 1), nxt].sum())
        count += w - 1
        start += w
    return float(np.exp(nll / max(count, 1)))


def _bytes_gate(
    original: Path, candidate: Path, progress: ProgressSink
) -> tuple[Gate, VerifyResult | None]:
    try:
        r = verify(original, candidate, progress=progress)
    except MoepackError as e:
        return Gate("bytes", False, f"verify failed: {e.message}"), None
    nums = {
        "bytes_compared": r.bytes_compared,
        "tensors_compared": r.tensors_compared,
        "tensors_permuted": r.tensors_permuted,
        "blocks_permuted": r.blocks_permuted,
    }
    if r.ok:
        return Gate("bytes", True, f"every byte accounted for ({r.bytes_compared:,})", nums), r
    d = r.difference
    return Gate("bytes", False, f"differs: {d.message if d else 'unknown'}", nums), r


@dataclass(frozen=True)
class CandidateOrder:
    """Per MoE block, CANDIDATE's slot -> ORIGINAL's expert (blocks absent: identity), and
    where that came from."""

    perms: dict[int, np.ndarray]
    source: str

    def perm(self, block: int, n_expert: int) -> np.ndarray:
        p = self.perms.get(block)
        return p if p is not None else np.arange(n_expert)


def candidate_order(verified: VerifyResult | None, candidate: Path) -> CandidateOrder:
    """The permutation the bytes gate found (recorded, or discovered from the slices when the
    file records none); the file's recorded one when verify stopped before it had one."""
    if verified is not None and verified.permutations is not None:
        perms = {b: np.asarray(p, dtype=np.int64) for b, p in verified.permutations.items()}
        if verified.permutation_source == "provenance":
            return CandidateOrder(perms, "recorded")
        found = "found by verify (the file records none)"
        return CandidateOrder(perms, found if perms else "identity (verify found none)")
    with MoeModel(candidate) as m:
        prov = read_provenance(m)
        if prov is None:
            return CandidateOrder({}, "identity (none recorded)")
        return CandidateOrder(
            {b.index: prov.perm(b.index, b.n_expert) for b in m.blocks}, "recorded"
        )


def _by_expert(ids: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's ids sorted, with their weights alongside."""
    order = np.argsort(ids, axis=1, kind="stable")
    return np.take_along_axis(ids, order, axis=1), np.take_along_axis(weights, order, axis=1)


def weight_envelope(a: DropinRun, other: DropinRun) -> float:
    """The largest change of any router weight between two runs of one model, over the
    (token, layer) where both route the same experts (matched by expert)."""
    worst = 0.0
    for layer in range(a.ids.shape[1]):
        ia, wa = _by_expert(np.asarray(a.ids[:, layer], np.int64), np.asarray(a.weights[:, layer]))
        ib, wb = _by_expert(
            np.asarray(other.ids[:, layer], np.int64), np.asarray(other.weights[:, layer])
        )
        same = np.all(ia == ib, axis=1)
        if same.any():
            d = np.abs(wa[same].astype(np.float64) - wb[same])
            if np.isfinite(d).any():
                worst = max(worst, float(np.nanmax(d)))
    return worst


@dataclass(frozen=True)
class OrderChange:
    """One (token, layer) whose experts CANDIDATE orders differently: the swapped pair with
    the widest ORIGINAL weight gap, and the two runs' weights of it."""

    token: int
    block: int
    experts: tuple[int, int]
    original: tuple[float, float]
    candidate: tuple[float, float]

    @property
    def gap(self) -> float:
        return abs(self.original[0] - self.original[1])

    def describe(self) -> str:
        (x, y), (a0, a1), (b0, b1) = self.experts, self.original, self.candidate
        return (
            f"token {self.token}, block {self.block}: experts {x} and {y} swapped, ORIGINAL's "
            f"weights {a0:.4f}/{a1:.4f}, CANDIDATE's {b0:.4f}/{b1:.4f}"
        )


def _order_changes(
    orig: np.ndarray, wa: np.ndarray, mapped: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For rows of the same set in another order: the widest ORIGINAL weight gap between two
    experts whose order differs, and that pair's positions in ORIGINAL's order."""
    k = orig.shape[1]
    # where each of ORIGINAL's experts sits in CANDIDATE's order
    rank = np.argmax(mapped[:, None, :] == orig[:, :, None], axis=2)
    p, q = np.triu_indices(k, 1)
    inverted = rank[:, p] > rank[:, q]  # [rows, pairs]
    gaps = np.abs(wa[:, p].astype(np.float64) - wa[:, q])
    gaps = np.where(inverted, np.nan_to_num(gaps, nan=np.inf), -1.0)
    pair = np.argmax(gaps, axis=1)
    return gaps[np.arange(len(gaps)), pair], p[pair], q[pair]


def _boundary_swap_gaps(
    orig: np.ndarray, wa: np.ndarray, mapped: np.ndarray, wb: np.ndarray
) -> np.ndarray:
    """For rows whose sets differ: how far apart the two runs' last experts' weights lie when
    that is the only difference (the first k-1 the same, in order: the k-th and (k+1)-th
    experts were a near-tie that rounding decided), +inf for any other set change. Top-1
    routing has no such tie to judge by (its one weight is 1 after renormalising)."""
    k = orig.shape[1]
    if k < 2:
        return np.full(len(orig), np.inf)
    head = np.all(orig[:, : k - 1] == mapped[:, : k - 1], axis=1)
    gap = np.abs(wa[:, k - 1].astype(np.float64) - wb[:, k - 1])
    return np.where(head & np.isfinite(gap), gap, np.inf)


def mapped_back(
    run: DropinRun, blocks: list[int], order: CandidateOrder, n_expert: int
) -> DropinRun:
    """``run`` with its expert ids mapped back through ``order`` (slot -> ORIGINAL's expert)."""
    ids = np.empty(run.ids.shape, dtype=np.int64)
    for layer, block in enumerate(blocks):
        ids[:, layer] = order.perm(block, n_expert)[np.asarray(run.ids[:, layer], np.int64)]
    return replace(run, ids=ids)


def routing_gate(
    a: DropinRun,
    b: DropinRun,
    a16: DropinRun,
    blocks: list[int],
    order: CandidateOrder,
    n_expert: int,
    not_run: list[int] | None = None,
    position: DropinRun | None = None,
) -> Gate:
    """CANDIDATE's routing (``b``) mapped back through ``order`` against ORIGINAL's (``a``):
    equal as sets and in order on every (token, layer) but for near-ties — two experts whose
    ORIGINAL weights lie within ``order_tolerance`` of each other (twice the largest weight
    change the F16-KV run (``a16``) and the position control (``position``, its ids already
    mapped back) make, added; see the module docstring) trading places, or the last expert
    traded for another whose weight in CANDIDATE lies within it of the one it had in ORIGINAL
    (rounding chose between the k-th and (k+1)-th)."""
    if a.ids.shape != b.ids.shape:
        return Gate("routing", False, f"routing shapes differ: {a.ids.shape} vs {b.ids.shape}")
    kv_move = weight_envelope(a, a16)
    position_move = weight_envelope(a, position) if position is not None else 0.0
    tolerance = 2.0 * (kv_move + position_move)
    ordered = sets = ties = set_ties = 0
    cells = a.ids.shape[0] * a.ids.shape[1]
    first_bad: tuple[int, int] | None = None
    closest_set_tie = 0.0
    worst: OrderChange | None = None
    closest_tie = 0.0
    for layer, block in enumerate(blocks):
        perm = order.perm(block, n_expert)
        mapped = perm[np.asarray(b.ids[:, layer], dtype=np.int64)]
        orig = np.asarray(a.ids[:, layer], dtype=np.int64)
        same_order = np.all(mapped == orig, axis=1)
        same_set = np.all(np.sort(mapped, axis=1) == np.sort(orig, axis=1), axis=1)
        ordered += int(same_order.sum())
        sets += int(same_set.sum())
        changed = np.flatnonzero(~same_set)
        if len(changed):
            gap = _boundary_swap_gaps(
                orig[changed],
                np.asarray(a.weights[changed, layer]),
                mapped[changed],
                np.asarray(b.weights[changed, layer]),
            )
            tied_set = gap <= tolerance
            set_ties += int(tied_set.sum())
            if tied_set.any():
                closest_set_tie = max(closest_set_tie, float(gap[tied_set].max()))
            if first_bad is None and not tied_set.all():
                first_bad = (int(changed[np.flatnonzero(~tied_set)[0]]), block)
        swapped = np.flatnonzero(same_set & ~same_order)
        if not len(swapped):
            continue
        wa = np.asarray(a.weights[swapped, layer])
        wb = np.asarray(b.weights[swapped, layer])
        gap, p, q = _order_changes(orig[swapped], wa, mapped[swapped])
        tied = gap <= tolerance
        ties += int(tied.sum())
        if tied.any():
            closest_tie = max(closest_tie, float(gap[tied].max()))
        if (~tied).any():
            r = int(np.argmax(np.where(tied, -1.0, gap)))
            x, y = int(orig[swapped[r], p[r]]), int(orig[swapped[r], q[r]])
            rank_b = {int(e): i for i, e in enumerate(mapped[swapped[r]])}
            change = OrderChange(
                token=int(swapped[r]),
                block=block,
                experts=(x, y),
                original=(float(wa[r, p[r]]), float(wa[r, q[r]])),
                candidate=(float(wb[r, rank_b[x]]), float(wb[r, rank_b[y]])),
            )
            if worst is None or change.gap > worst.gap:
                worst = change
    nums: dict[str, Any] = {
        "cells": cells,
        "same_set": sets / cells,
        "same_order": ordered / cells,
        "near_ties": ties,
        "set_near_ties": set_ties,
        "same_set_but_near_ties": (sets + set_ties) / cells,
        "same_order_but_near_ties": (ordered + ties + set_ties) / cells,
        "order_tolerance": tolerance,
        "order_tolerance_from": "F16-KV run and position control" if position else "F16-KV run",
        "weight_move_kv": kv_move,
        "weight_move_position": position_move,
        "permutation": order.source,
        "blocks": list(blocks),
        "not_run_blocks": list(not_run or []),
    }
    if worst is not None:
        nums["worst_order_change"] = {
            "token": worst.token,
            "block": worst.block,
            "experts": list(worst.experts),
            "original_weights": list(worst.original),
            "candidate_weights": list(worst.candidate),
        }
    ok = sets + set_ties == cells and ordered + ties + set_ties == cells
    tie_note = (
        f" but {ties:,} near-tie{'s' if ties != 1 else ''} (ORIGINAL weights within "
        f"{closest_tie:.3g} of each other; tolerance {tolerance:.3g} from the "
        f"{nums['order_tolerance_from']})"
        if ties
        else ""
    )
    if set_ties:
        tie_note += (
            f"{' and' if ties else ' but'} {set_ties:,} selection near-tie"
            f"{'s' if set_ties != 1 else ''} (the last expert traded for one whose weight lies "
            f"within {closest_set_tie:.3g} of it)"
        )
    if ok:
        summary = f"100 % of {cells:,} (token, layer) map back, as sets and in order{tie_note}"
    else:
        where = (
            f"; first set change at token {first_bad[0]}, block {first_bad[1]}" if first_bad else ""
        )
        worst_note = (
            f"; worst order change at {worst.describe()}, {worst.gap:.3g} apart, beyond the "
            f"near-tie tolerance {tolerance:.3g}"
            if worst is not None
            else ""
        )
        summary = (
            f"{100 * sets / cells:.2f} % as sets, {100 * (ordered + ties) / cells:.2f} % in "
            f"order{where}{worst_note}"
        )
    return Gate("routing", ok, summary, nums)


def check_dropin(
    original: str | Path,
    candidate: str | Path,
    *,
    n_tokens: int = 1024,
    text: str | None = None,
    window: int = 256,
    threads: int = 2,
    progress: ProgressSink = NULL_PROGRESS,
) -> DropinResult:
    """Run the four gates on ORIGINAL and CANDIDATE (see the module docstring)."""
    orig, cand = Path(original), Path(candidate)
    if n_tokens < 2 or window < 2:
        raise BadInput("tokens and window must be >= 2")
    facts = model_facts(orig)
    cand_facts = model_facts(cand)
    if (cand_facts.blocks, cand_facts.n_expert, cand_facts.k) != (
        facts.blocks,
        facts.n_expert,
        facts.k,
    ):
        raise BadInput("not a rewrite of the original: MoE blocks or expert counts differ", cand)
    with MoeModel(orig) as m:
        not_run = m.not_run_block_indices
    body = text if text is not None else default_text()
    bytes_gate, verified = _bytes_gate(orig, cand, progress)
    gates = [bytes_gate]
    order = candidate_order(verified, cand)
    opts = {"window": window, "threads": threads}
    with scratch_folder("check-dropin") as tmp:
        control = write_position_control(orig, tmp, progress)
        jobs = [
            ("a1", orig, "f32", "the first run of ORIGINAL (F32 KV cache)"),
            ("a2", orig, "f32", "the control run of ORIGINAL (F32 KV cache)"),
            ("b", cand, "f32", "the run of CANDIDATE (F32 KV cache)"),
            ("a16", orig, "f16", "the envelope run of ORIGINAL (F16 KV cache)"),
        ]
        if control.path is not None:
            label = "the position control run (ORIGINAL, experts reordered; F32 KV cache)"
            jobs.append(("pos", control.path, "f32", label))
        progress.start("llama.cpp runs", len(jobs), unit="runs")
        runs = {}
        for name, model, kv, label in jobs:
            runs[name] = _run(model, facts, tmp / name, body, n_tokens, kv, opts, label)
            progress.advance(1)
        progress.finish()
        a1, a2, b, a16 = runs["a1"], runs["a2"], runs["b"], runs["a16"]
        pos = _position_run(runs.get("pos"), control, facts)
        if not np.array_equal(a1.tokens, b.tokens):
            raise BadInput("the candidate tokenizes the text differently", cand)
        same_logits = bool(np.array_equal(np.asarray(a1.logits), np.asarray(a2.logits)))
        same_ids = bool(np.array_equal(np.asarray(a1.ids), np.asarray(a2.ids)))
        max_diff = float(np.max(np.abs(np.asarray(a1.logits, np.float64) - np.asarray(a2.logits))))
        gates.append(
            Gate(
                "control",
                same_logits and same_ids,
                "two runs of ORIGINAL are bit-identical"
                if same_logits and same_ids
                else f"two runs of ORIGINAL differ (max |logit diff| {max_diff:.3g})",
                {"bit_identical": same_logits, "routing_identical": same_ids, "max_abs": max_diff},
            )
        )
        gates.append(
            routing_gate(a1, b, a16, facts.blocks, order, facts.n_expert, not_run, position=pos)
        )
        gates.append(output_gate(a1, b, a16, pos, control.skipped))
        tokens, start = int(a1.logits.shape[0]), a1.start_token
        del runs, a1, a2, b, a16, pos
    return DropinResult(orig, cand, tokens, gates, start_token=start)


def _position_run(
    run: DropinRun | None, control: PositionControl, facts: ModelFacts
) -> DropinRun | None:
    """The position control's run with its ids mapped back to ORIGINAL's experts."""
    if run is None:
        return None
    order = CandidateOrder(control.perms, "position control")
    return mapped_back(run, facts.blocks, order, facts.n_expert)


def combined_envelope(kv_kl: float, position_kl: float) -> float:
    """The KL a candidate may lie from ORIGINAL: the distances of the F16-KV run and of the
    position control from ORIGINAL, added as distances (for small changes ``sqrt(KL)`` is one,
    up to a constant factor), squared back. A reordered candidate differs from ORIGINAL by
    its own reassociation, which one control only samples: the sum covers a candidate up to
    that far from the control's own change (the runs' KLs vary with where the rounding
    falls)."""
    if position_kl == 0.0 or kv_kl == 0.0:  # one change measured: exactly that one
        return max(kv_kl, position_kl)
    return float((np.sqrt(kv_kl) + np.sqrt(position_kl)) ** 2)


def output_gate(
    a: DropinRun,
    b: DropinRun,
    a16: DropinRun,
    position: DropinRun | None = None,
    position_skipped: str = "",
) -> Gate:
    """Mean KL(ORIGINAL ‖ CANDIDATE) against the envelope measured on the same tokens in this
    run, never a constant: mean KL(ORIGINAL F32 KV ‖ ORIGINAL F16 KV), how far a setting of the
    engine moves the same model's output here, combined (``combined_envelope``) with mean
    KL(ORIGINAL ‖ position control), how far moving its experts alone moves it (0 without a
    control: no expert may move, or ``position_skipped`` says why). ``margin`` is KL over envelope (a pass by a hair is a margin
    near 1, and says only that the candidate is as close as those changes)."""
    kl = mean_kl(a.logits, b.logits)
    kv_kl = mean_kl(a.logits, a16.logits)
    position_kl = mean_kl(a.logits, position.logits) if position is not None else 0.0
    envelope = combined_envelope(kv_kl, position_kl)
    ppl = {
        "original": perplexity(a),
        "candidate": perplexity(b),
        "original_f16_kv": perplexity(a16),
    }
    if position is not None:
        ppl["position_control"] = perplexity(position)
    n = int(a.logits.shape[0])
    return Gate(
        "output",
        kl <= envelope,
        f"mean KL {kl:.3g} vs envelope {envelope:.3g} (measured: F32/F16 KV {kv_kl:.3g}, "
        + (
            f"no position control: {position_skipped}"
            if position_skipped
            else f"expert position {position_kl:.3g}"
        )
        + f") over {n:,} tokens",
        {
            "kl": kl,
            "envelope_kl": envelope,
            "envelope": "measured: (sqrt(kv_envelope_kl) + sqrt(position_kl))^2, "
            "kv_envelope_kl = mean KL(ORIGINAL F32 KV || ORIGINAL F16 KV), position_kl = mean "
            "KL(ORIGINAL || ORIGINAL with its experts reordered), same tokens",
            "kv_envelope_kl": kv_kl,
            "position_kl": position_kl,
            "position_control": position_skipped or ("run" if position is not None else "none"),
            "margin": kl / envelope if envelope > 0 else (0.0 if kl == 0 else float("inf")),
            "margin_kv_only": kl / kv_kl if kv_kl > 0 else (0.0 if kl == 0 else float("inf")),
            "perplexity": ppl,
            "tokens": n,
        },
    )
