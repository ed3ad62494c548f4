"""The planner: an expert order per block, searched on the cost model's modelled read time.

Per MoE block, ways to order from co-activation seriation (the greedy chain of
``coactivation_plan`` over the last k placed, the order ``plan`` writes; the same chain
following only the last placed expert; a spectral order, the Fiedler vector of the
co-activation graph's Laplacian) and the best of them improved by local search (move an expert
next to its strongest partner, keep the move when the modelled time drops), all on the
*training* tokens. Which way wins is decided on the training tokens too, as the file's own
order is: each way is built on three quarters of them and judged on the rest (contiguous
pieces), and another way replaces ``plan``'s chain only when it is cheaper there by more than
``SIGNIFICANCE`` standard errors; the winner is built again on all of them. Blocks
with routing rules (grouped routing: llama.cpp reads expert indices) are planned within them:
the chain is ``constrained_chain`` and a candidate or move that breaks a rule is dropped. The
objective is the cost model's time for the ``reorder`` layout: per token, the runs of adjacent
chosen slots, each run one request per expert tensor, each request timed on the surface at its
own size (without a surface: requests). Deterministic for a seed. A block keeps the file's
own order unless the winner leads it there by more than chance too, and the result says so.
The held-out tokens only judge the plan: no choice is made on them (one that was, a 1 % gain
required there, kept the file's order where ``plan``'s chain gained less, and so fell behind
it on the very tokens it reported).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..checkpoint.expert_index import planning_units
from ..checkpoint.model import MoeBlock, MoeModel
from ..errors import BadInput
from ..storage.engine import get_engine
from ..storage.modes import Mode
from ..storage.surface import Surface
from ..trace.core import RoutingTrace
from .coactivation_plan import constrained_chain
from .cost import fit_surface
from .heldout import HeldOutSplit, split_held_out
from .plan import LayerPlan, Plan

SEARCH_TOKENS = 4096
"""Training tokens the local search evaluates (an evenly spaced sample of longer traces)."""
MIN_CHECK_TOKENS = 64
SELECTION_PIECES = 8
"""The training tokens are cut into this many contiguous pieces; every fourth judges the ways."""
CHAIN = "greedy chain"
"""The seriation candidate that is ``plan``'s own order (``coactivation_plan``'s chain)."""
SEARCH = "search"
"""The local search's order, from the best seriation candidate."""
FILE_ORDER = "file order"
SIGNIFICANCE = 2.0
"""Standard errors by which another way must beat ``plan``'s chain on the judging tokens."""
"""Below twice this many training tokens the search fits all of them and is judged on all."""


def run_cost_table(
    block: MoeBlock, k: int, surface: Surface | None, queue_depth: int
) -> np.ndarray:
    """``t[L]``: modelled cost of one request spanning ``L`` adjacent slots, for every expert
    tensor (``L`` up to ``k``; pass the expert count when gaps are read through)."""
    tab = np.zeros(k + 1, dtype=np.float64)
    for length in range(1, k + 1):
        for t in block.weight_tensors:
            size = length * t.slice_bytes
            tab[length] += size / surface.bandwidth(size, queue_depth) if surface else 1.0
    return tab


def gap_slots(block: MoeBlock, merge_gap: int, surface: Surface | None, queue_depth: int) -> int:
    """The gap (in slots) the cost model reads through for this block: at most ``merge_gap``
    and, with a surface, only while the gap's bytes cost less than one request (as
    ``cost.token_requests`` decides)."""
    if merge_gap <= 0 or not block.weight_tensors:
        return 0
    slice_bytes = min(t.slice_bytes for t in block.weight_tensors)
    if surface is None:
        return merge_gap
    fit = fit_surface(surface, queue_depth)
    return min(merge_gap, int(fit.t_op * fit.bandwidth) // slice_bytes)


def order_cost(ids: np.ndarray, slot_of: np.ndarray, tab: np.ndarray, gap: int = 0) -> float:
    """Total modelled cost of ``ids[tokens, k]`` with experts in slots ``slot_of``: per token,
    chosen slots at most ``gap`` empty slots apart are one request spanning them."""
    if ids.size == 0:
        return 0.0
    return float(token_costs(ids, slot_of, tab, gap).sum())


def token_costs(ids: np.ndarray, slot_of: np.ndarray, tab: np.ndarray, gap: int = 0) -> np.ndarray:
    """``float64[tokens]``: each token's modelled cost (``order_cost`` is their sum)."""
    if ids.size == 0:
        return np.zeros(len(ids))
    slots = np.sort(slot_of[ids], axis=1)
    brk = np.ones(slots.shape, dtype=bool)
    brk[:, 1:] = np.diff(slots, axis=1) > gap + 1
    flat = slots.ravel()
    starts = np.flatnonzero(brk.ravel())
    ends = np.append(starts[1:], flat.size) - 1
    token = starts // slots.shape[1]
    return np.bincount(token, weights=tab[flat[ends] - flat[starts] + 1], minlength=len(ids))


def spectral_order(coact: np.ndarray) -> np.ndarray:
    """Experts sorted by the Fiedler vector of the co-activation graph (ties by index)."""
    w = coact.astype(np.float64)
    np.fill_diagonal(w, 0.0)
    lap = np.diag(w.sum(axis=1)) - w
    _vals, vecs = np.linalg.eigh(lap)
    fiedler = vecs[:, 1] if len(w) > 1 else np.zeros(len(w))
    if fiedler[np.argmax(np.abs(fiedler))] < 0:  # eigenvectors have no sign: fix one
        fiedler = -fiedler
    return np.lexsort((np.arange(len(w)), np.round(fiedler, 12))).astype(np.int64)


def _slots(perm: np.ndarray) -> np.ndarray:
    slot_of = np.empty(len(perm), dtype=np.int64)
    slot_of[perm] = np.arange(len(perm))
    return slot_of


def _coactivation(ids: np.ndarray, n: int) -> np.ndarray:
    onehot = np.zeros((len(ids), n), dtype=np.float32)
    np.put_along_axis(onehot, ids, 1.0, axis=1)
    return onehot.T @ onehot


def local_search(
    perm: np.ndarray,
    ids: np.ndarray,
    tab: np.ndarray,
    coact: np.ndarray,
    moves: int,
    seed: int,
    block: MoeBlock | None = None,
    gap: int = 0,
) -> np.ndarray:
    """Insertion moves (an expert next to a strong partner) kept when the cost drops and, for
    a ``block`` with routing rules, when the order still keeps them."""
    rng = np.random.default_rng(seed)
    order = list(int(x) for x in perm)
    best = order_cost(ids, _slots(np.asarray(order)), tab, gap)
    partners = np.argsort(-(coact - np.diag(np.diag(coact))), axis=1)[:, :4]
    for _ in range(moves):
        e = int(rng.integers(len(order)))
        p = int(partners[e, rng.integers(partners.shape[1])])
        if p == e:
            continue
        trial = [x for x in order if x != e]
        at = trial.index(p) + int(rng.integers(2))  # just before or just after the partner
        trial.insert(at, e)
        if block is not None and block.constraints and block.violation(np.asarray(trial)):
            continue
        cost = order_cost(ids, _slots(np.asarray(trial)), tab, gap)
        if cost < best:
            order, best = trial, cost
    return np.asarray(order, dtype=np.int64)


@dataclass
class BlockPlanResult:
    """One block's order and its modelled cost, on training and held-out tokens."""

    block: int
    perm: np.ndarray
    train_before: float
    train_after: float
    held_before: float
    held_after: float
    candidate: str
    left_alone: str | None = None
    won: str = FILE_ORDER  # the way chosen on the training tokens (``selection``)
    selection: dict[str, float] = field(default_factory=dict)  # way -> gain where judged
    chain_train: float = 0.0  # ``plan``'s chain (``CHAIN``) on the same tokens, for reference
    chain_held: float = 0.0

    @property
    def held_gain(self) -> float:
        return self.held_before / self.held_after if self.held_after else 1.0

    @property
    def train_gain(self) -> float:
        return self.train_before / self.train_after if self.train_after else 1.0

    @property
    def chain_held_gain(self) -> float:
        """``plan``'s chain on the held-out tokens (what it gains over the file's order)."""
        return self.held_before / self.chain_held if self.chain_held else 1.0

    def to_json(self) -> dict[str, Any]:
        return {
            "block": self.block,
            "candidate": self.candidate,
            "won": self.won,
            "selection_gains": dict(self.selection),
            "train_gain": self.train_gain,
            "held_out_gain": self.held_gain,
            "gap": self.train_gain - self.held_gain,
            "chain_held_out_gain": self.chain_held_gain,
            "left_alone": self.left_alone,
        }


@dataclass(kw_only=True)
class PlannerResult:
    plan: Plan
    blocks: list[BlockPlanResult]
    train_tokens: tuple[int, int]
    held_tokens: tuple[int, int]
    timed: bool
    notes: list[str] = field(default_factory=list)
    held_out: HeldOutSplit | None = None
    queue_depth: int = 1
    engine: str | None = None
    merge_gap: int = 0
    map_block: int | None = None  # the block a co-activation map was drawn of, if any

    def gain(self, part: str = "held") -> float:
        before = sum(getattr(b, f"{part}_before") for b in self.blocks)
        after = sum(getattr(b, f"{part}_after") for b in self.blocks)
        return before / after if after else 1.0

    def chain_gain(self, part: str = "held") -> float:
        """What ``plan``'s chain gains over the file's order, summed over the blocks."""
        before = sum(getattr(b, f"{part}_before") for b in self.blocks)
        after = sum(getattr(b, f"chain_{part}") for b in self.blocks)
        return before / after if after else 1.0

    def won(self) -> dict[str, int]:
        """How many blocks each way of ordering won (on the training tokens)."""
        out: dict[str, int] = {}
        for b in self.blocks:
            out[b.won] = out.get(b.won, 0) + 1
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "objective": "modelled read time" if self.timed else "requests",
            "queue_depth": self.queue_depth,
            "engine": self.engine,
            "merge_gap": self.merge_gap,
            "map_block": self.map_block,
            "held_out": self.held_out.to_json() if self.held_out else None,
            "train_tokens": list(self.train_tokens),
            "held_out_tokens": list(self.held_tokens),
            "train_gain": self.gain("train"),
            "held_out_gain": self.gain("held"),
            "gap": self.gain("train") - self.gain("held"),
            "chain_train_gain": self.chain_gain("train"),
            "chain_held_out_gain": self.chain_gain("held"),
            "won": self.won(),
            "blocks": [b.to_json() for b in self.blocks],
            "notes": self.notes,
            "plan": self.plan.to_json(),
        }


def _sample(ids: np.ndarray, cap: int) -> np.ndarray:
    if len(ids) <= cap:
        return ids
    return ids[np.linspace(0, len(ids) - 1, cap).astype(np.int64)]


def selection_rows(tokens: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The training rows each way of ordering is built on and the rows it is then judged on
    to choose the way (every fourth of ``SELECTION_PIECES`` contiguous pieces: neighbouring
    tokens share experts, so interleaved rows would judge a way on what it was built from);
    None when too few tokens to spare any."""
    if tokens < SELECTION_PIECES * MIN_CHECK_TOKENS:
        return None
    piece = np.arange(tokens) * SELECTION_PIECES // tokens
    check = piece % 4 == 3
    return np.flatnonzero(~check), np.flatnonzero(check)


def _leads(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether per-token costs ``b`` are below ``a`` by more than ``SIGNIFICANCE`` standard
    errors of the per-token difference (a smaller lead is the luck of those tokens)."""
    lead = a - b
    error = float(lead.std()) / max(1.0, float(np.sqrt(lead.size)))
    return bool(lead.size) and float(lead.mean()) > SIGNIFICANCE * error


def _choose(per_token: dict[str, np.ndarray]) -> str:
    """The way to order, from each way's per-token costs on the judging tokens: ``plan``'s
    chain unless another way leads it (``_leads``: the chain is the order ``plan`` writes, so
    the planner is never behind it but by chance), and that way only if it leads the file's
    own order (a repack for a lead within chance is a repack for nothing)."""
    won = CHAIN
    for way in sorted(per_token):
        if way in (CHAIN, FILE_ORDER):
            continue
        if _leads(per_token[CHAIN], per_token[way]) and per_token[way].sum() < per_token[won].sum():
            won = way
    return won if _leads(per_token[FILE_ORDER], per_token[won]) else FILE_ORDER


def _orders(
    block: MoeBlock,
    train: np.ndarray,
    tab: np.ndarray,
    seed: int,
    moves: int,
    order_groups: bool,
    gap: int,
) -> tuple[dict[str, np.ndarray], str]:
    """Every way's order of one block built on ``train``: the seriation candidates, ``plan``'s
    own chain among them, and the local search from the best of them (``SEARCH``); and which
    candidate the search started from."""
    n = block.n_expert
    sample = _sample(train, SEARCH_TOKENS)
    coact = _coactivation(train, n)
    counts = np.bincount(train.ravel(), minlength=n)
    units = planning_units(block.constraints, n)
    ci = coact.astype(np.int64)
    orders = {
        CHAIN: constrained_chain(ci, counts, train.shape[1], units, order_groups),
        "path chain": constrained_chain(ci, counts, 1, units, order_groups),
    }
    spectral = spectral_order(coact)
    if block.violation(spectral) is None:
        orders["spectral"] = spectral
    costs = {name: order_cost(sample, _slots(p), tab, gap) for name, p in orders.items()}
    start = min(costs, key=lambda c: (costs[c], c))
    orders[SEARCH] = local_search(
        orders[start], sample, tab, coact, moves, seed + block.index, block, gap
    )
    return orders, start


def plan_block(
    block: MoeBlock,
    train: np.ndarray,
    held: np.ndarray,
    tab: np.ndarray,
    seed: int = 0,
    moves: int = 200,
    order_groups: bool = True,
    gap: int = 0,
) -> BlockPlanResult:
    """The best order for one block: seriation candidates, local search, held-out judgement
    (``tab`` from ``run_cost_table``, long enough for runs spanning ``gap`` empty slots)."""
    n = block.n_expert
    ident = np.arange(n, dtype=np.int64)
    # Which way to order is chosen on training tokens only, as the file's own order is: each
    # way built on part of them and judged on the rest (a way judged on what it was built
    # from flatters itself: the path chain and the search fit noise that the greedy chain,
    # ``plan``'s, does not), the way that wins built again on all of them.
    orders, start = _orders(block, train, tab, seed, moves, order_groups, gap)
    judged, judge = orders, train
    split = selection_rows(len(train))
    if split is not None:
        fit, check = split
        judged, _ = _orders(block, train[fit], tab, seed, moves, order_groups, gap)
        judge = train[check]
    per_token = {c: token_costs(judge, _slots(p), tab, gap) for c, p in judged.items()}
    per_token[FILE_ORDER] = token_costs(judge, ident, tab, gap)
    selection = {c: float(v.sum()) for c, v in per_token.items()}
    won = _choose(per_token)
    perm = ident if won == FILE_ORDER else orders[won]
    name = f"search from {start}" if won == SEARCH else won
    chain = _slots(orders[CHAIN])
    chain_costs = (order_cost(train, chain, tab, gap), order_cost(held, chain, tab, gap))
    gains = {c: selection[FILE_ORDER] / v if v else 1.0 for c, v in selection.items()}
    why = block.violation(perm)
    if why is not None:  # every candidate and move keeps the rules
        raise AssertionError(f"block {block.index}: planner broke a routing rule: {why}")
    train_before = order_cost(train, ident, tab, gap)
    train_after = order_cost(train, _slots(perm), tab, gap)
    held_before = order_cost(held, ident, tab, gap)
    held_after = order_cost(held, _slots(perm), tab, gap)
    left = None
    if won == FILE_ORDER or train_after >= train_before:
        left = "no order beats the file's own on the training tokens by more than chance"
    result = BlockPlanResult(
        block.index, perm, train_before, train_after, held_before, held_after, name, left
    )
    result.won, result.selection = won, gains
    result.chain_train, result.chain_held = chain_costs
    if left:
        result.perm, result.train_after, result.held_after = ident, train_before, held_before
    return result


@dataclass(frozen=True)
class SearchOptions:
    """How the planner searches: the cost model's queue depth (``engine``'s, when given: it
    must keep that many reads in flight) and read-through of gaps of up to ``merge_gap``
    slices, the share of tokens held out to judge on, the seed and local-search moves, and
    whether whole routing groups may move (``order_groups``)."""

    queue_depth: int = 1
    engine: str | None = None
    merge_gap: int = 0
    holdout: float = 0.25
    seed: int = 0
    moves: int = 200
    order_groups: bool = True

    def check(self) -> None:
        if self.merge_gap < 0:
            raise BadInput(f"`merge_gap` must be 0 or more slices, got {self.merge_gap}")


def plan_model(
    model: MoeModel,
    trace: RoutingTrace,
    options: SearchOptions | None = None,
    *,
    surface: Surface | None = None,
) -> PlannerResult:
    """A plan for every MoE block the trace covers: made on about ``1 - options.holdout`` of
    the tokens (whole prompts when the trace records several), judged on the rest, on the
    cost model (read time with a ``surface``, else requests)."""
    opts = options or SearchOptions()
    opts.check()
    queue_depth, engine, merge_gap = opts.queue_depth, opts.engine, opts.merge_gap
    notes: list[str] = []
    if engine is not None:
        get_engine(engine).check(Mode.DIRECT, queue_depth)
        if surface is not None and surface.engine and surface.engine != engine:
            notes.append(
                f"the surface was measured with engine {surface.engine!r}, not {engine!r}: "
                "its times may not hold for this engine"
            )
    if surface is not None and queue_depth not in surface.queue_depths:
        notes.append(
            f"the surface has no cells at queue depth {queue_depth} (it has "
            f"{', '.join(map(str, surface.queue_depths))}): times are interpolated"
        )
    blocks = trace.check_against(model)
    split = split_held_out(trace, opts.holdout)
    results = []
    for layer, b in enumerate(blocks):
        block = model.block(b)
        ids = np.asarray(trace.ids[:, layer, :], dtype=np.int64)
        gap = gap_slots(block, merge_gap, surface, queue_depth)
        span = block.n_expert if gap else trace.k
        tab = run_cost_table(block, span, surface, queue_depth)
        results.append(
            plan_block(
                block,
                ids[split.train_rows],
                ids[split.held_rows],
                tab,
                opts.seed,
                opts.moves,
                opts.order_groups,
                gap,
            )
        )
    plan = Plan(
        [
            LayerPlan(
                r.block,
                r.perm,
                [t.name for t in model.block(r.block).tensors],
                speedup=r.held_gain,
            )
            for r in results
        ],
        model.fingerprint,
        str(model.path),
        str(trace.path) if trace.path else None,
        source=f"seriation + local search on modelled {'time' if surface else 'requests'} "
        f"at queue depth {queue_depth}, seed {opts.seed}",
    )
    if surface is None:
        notes.append("no surface: the objective is requests, not read time")
    return PlannerResult(
        plan=plan,
        blocks=results,
        train_tokens=split.train_range,
        held_tokens=split.held_range,
        timed=surface is not None,
        notes=notes,
        held_out=split,
        queue_depth=queue_depth,
        engine=engine,
        merge_gap=merge_gap,
    )
