"""Where an expert's *index*, not only its identity, enters llama.cpp's MoE computation.

A permutation that moves every expert-axis tensor together keeps each expert's weights intact,
but llama.cpp (0.3.36's ``build_moe_ffn`` and ``src/models/*.cpp``) also reads positions:

* **grouped routing** (``<arch>.expert_group_count`` > 1; any architecture, DeepSeek-V3 style):
  the experts are split into ``n_group`` runs of consecutive indices, the best
  ``expert_group_used_count`` groups are chosen first and top-k is taken inside them. Experts may
  move only inside their group, or with their whole group.
* **chunk experts** (``grovemoe``, ``<arch>.experts_per_group``): expert ``e`` feeds chunk expert
  ``e // experts_per_group``, and chunk ``c`` is weighted by the router probability *at index*
  ``c``. Experts may move only inside their chunk group, and the first ``n_chunk`` experts not
  at all.
* **token -> expert tables** (``ffn_gate_tid2eid``, DeepSeek-4 hash layers): the tensor's values
  are expert indices; moving bytes cannot keep them true, so such a block is not permuted.

Each rule is an ``IndexConstraint``; a permutation that breaks one is named, never written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

TOKEN_TABLE_BASES = ("ffn_gate_tid2eid",)


@dataclass(frozen=True)
class IndexConstraint:
    """Permutations allowed on one block's expert axis: experts stay in their run of
    ``group_size`` consecutive indices (the runs themselves may trade places when
    ``movable``), and experts ``0 .. fixed-1`` stay where they are."""

    kind: str  # grouped-routing / chunk-experts / token-table / indivisible-groups
    group_size: int
    movable: bool
    description: str
    fixed: int = 0
    groups_used: int = 0  # grouped routing: how many groups llama.cpp picks per token

    @property
    def identity_only(self) -> bool:
        return self.group_size <= 1 and not self.movable

    def violation(self, perm: np.ndarray) -> str | None:
        """Why ``perm`` (``perm[slot] = expert``) breaks this rule, or None."""
        moved = [s for s in range(min(self.fixed, len(perm))) if int(perm[s]) != s]
        if moved:
            s = moved[0]
            return f"expert {int(perm[s])} goes to slot {s}, where only expert {s} may stay"
        size = self.group_size
        if self.identity_only:
            slot = int(np.flatnonzero(perm != np.arange(len(perm)))[0])
            return f"expert {int(perm[slot])} goes to slot {slot}"
        for g in range(len(perm) // size):
            experts = perm[g * size : (g + 1) * size]
            sources = sorted({int(e) // size for e in experts})
            if len(sources) > 1:
                stray = next(int(e) for e in experts if int(e) // size != sources[0])
                return (
                    f"slots {g * size}-{(g + 1) * size - 1} (group {g}) mix experts of groups "
                    f"{', '.join(map(str, sources))} (expert {stray} is in group "
                    f"{stray // size})"
                )
            if not self.movable and sources[0] != g:
                return (
                    f"experts {int(experts.min())}-{int(experts.max())} (group {sources[0]}) go "
                    f"to group {g}'s slots; groups may not trade places here"
                )
        return None

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "group_size": self.group_size,
            "movable": self.movable,
            "fixed": self.fixed,
            "groups_used": self.groups_used,
            "description": self.description,
        }


def index_constraints(
    architecture: str,
    n_expert: int,
    n_group: int,
    n_group_used: int,
    experts_per_chunk: int,
    token_tables: list[str],
) -> list[IndexConstraint]:
    """The rules llama.cpp's graph imposes on a block with ``n_expert`` experts."""
    out: list[IndexConstraint] = []
    if n_group > 1:
        if n_expert % n_group:
            out.append(
                IndexConstraint(
                    "indivisible-groups",
                    1,
                    False,
                    f"{n_expert} experts do not split into {n_group} routing groups; "
                    f"llama.cpp refuses the file, moepack keeps the order",
                )
            )
        else:
            size = n_expert // n_group
            out.append(
                IndexConstraint(
                    "grouped-routing",
                    size,
                    True,
                    f"{n_group} routing groups of {size} experts, {n_group_used} chosen per "
                    f"token: experts move only within their group or with the whole group",
                    groups_used=n_group_used,
                )
            )
    if architecture == "grovemoe" and experts_per_chunk > 0:
        n_chunk = n_expert // experts_per_chunk
        out.append(
            IndexConstraint(
                "chunk-experts",
                experts_per_chunk,
                False,
                f"expert e feeds chunk expert e // {experts_per_chunk}, weighted by the router "
                f"probability at index c: experts move only within their chunk group, and "
                f"experts 0-{n_chunk - 1} not at all",
                fixed=n_chunk,
            )
        )
    for name in token_tables:
        out.append(
            IndexConstraint(
                "token-table",
                1,
                False,
                f"{name} holds expert indices as values (token -> expert routing); "
                f"moepack does not rewrite them, so the order stays",
            )
        )
    return out


def first_violation(constraints: list[IndexConstraint], perm: np.ndarray) -> str | None:
    """The first rule ``perm`` breaks, described, or None (the identity never breaks one)."""
    if np.array_equal(perm, np.arange(len(perm))):
        return None
    for c in constraints:
        why = c.violation(perm)
        if why is not None:
            return f"{why} ({c.description})"
    return None


@dataclass(frozen=True)
class PlanningUnits:
    """How a planner may reorder a constrained block: freely inside runs of ``size``
    consecutive experts, runs reordered as wholes only when ``movable``, experts below
    ``fixed`` untouched. ``size == n_expert`` and ``fixed == 0`` is a free block."""

    size: int
    movable: bool
    fixed: int
    groups_used: int


def planning_units(constraints: list[IndexConstraint], n_expert: int) -> PlanningUnits:
    """The finest structure that satisfies every rule at once."""
    if not constraints:
        return PlanningUnits(n_expert, False, 0, 0)
    if any(c.identity_only for c in constraints):
        return PlanningUnits(1, False, n_expert, 0)
    size = math.gcd(*(c.group_size for c in constraints))
    movable = len(constraints) == 1 and constraints[0].movable and constraints[0].fixed == 0
    fixed = max(c.fixed for c in constraints)
    used = max(c.groups_used for c in constraints)
    return PlanningUnits(size, movable, fixed, used)
