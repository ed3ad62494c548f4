"""What a capture of a model with planted routing should show, and whether it does.

Expectations for top-k = cluster size (``C`` clusters, ``q`` coupling, ``s`` stay, ``π`` the
stationary topic distribution of the prompt chain, ``r`` the chance that two consecutive
tokens of one topic are the same token). A token is on its topic's cluster with probability
``q``, else on one of the other ``C − 1`` clusters uniformly:

- layer coupling (layer l+1's cluster is the one layer l's predicts) = ``q² + (1−q)²/(C−1)``;
- reuse at lag 1 (share of a token's experts the previous token also chose) =
  ``s·(r + (1−r)·same) + (1−s)·other`` with ``same = q² + (1−q)²/(C−1)`` and
  ``other = 2q(1−q)/(C−1) + (1−q)²(C−2)/(C−1)²``;
- popularity: the cluster of topic z is chosen with ``P = q·π_z + (1−q)(1−π_z)/(C−1)``;
  hot recall (routings landing on the k busiest experts) = ``max P``;
- lift of a pair inside a cluster = ``1 / P`` (always chosen together), across clusters 0,
  so the share of pairs above 2 × independence (``trace stats``' ``lift_above_2x``) is the
  share of pairs inside a cluster, ``(c − 1)/(E − 1)`` (when every ``P < 0.5``).

Reuse, hot-k share and the lift share are measured by ``trace stats``
(``moepack.trace.routing_stats``); cluster purity, layer coupling and in-cluster lift, which
need the planted clusters, here.

Which tokens follow their topic is fixed per token id and layer (an exact share ``q`` of
each topic's vocabulary), so how often the *text* meets them varies a little: the check
compares means over layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..checkpoint.routing import FIRST_WORD, RoutingPlan
from ..errors import BadInput
from ..trace.core import RoutingTrace
from ..trace.routing_stats import routing_stats
from ..trace.stats import coactivation, expert_counts

TOLERANCE = {
    "reuse_lag1": 0.06,
    "layer_coupling": 0.08,
    "hot_recall": 0.06,
    "lift_above_2x": 0.02,
    "lift_ratio": 0.25,
}


def stationary_topics(plan: RoutingPlan) -> np.ndarray:
    """The topic distribution the prompt chain settles to (stay, else move by popularity)."""
    p, s, n = plan.popularity, plan.spec.stay, plan.topics
    move = np.tile(p, (n, 1))
    np.fill_diagonal(move, 0.0)
    move /= move.sum(axis=1, keepdims=True)
    chain = s * np.eye(n) + (1 - s) * move
    w, v = np.linalg.eig(chain.T)
    pi: np.ndarray = np.abs(np.real(v[:, np.argmin(np.abs(w - 1))]))
    out: np.ndarray = pi / pi.sum()
    return out


def cluster_probabilities(plan: RoutingPlan) -> np.ndarray:
    """``[layers, clusters]``: how often each cluster is chosen."""
    q, c = plan.spec.coupling, plan.clusters
    pi = stationary_topics(plan)
    out = np.empty((len(plan.blocks), c))
    for li in range(len(plan.blocks)):
        out[li, plan.topic_cluster[li]] = q * pi + (1 - q) * (1 - pi) / (c - 1)
    return out


@dataclass
class RoutingExpectation:
    reuse_lag1: float
    layer_coupling: float
    hot_recall: float
    lift_above_2x: float  # share of expert pairs co-chosen above 2x independence
    lift_in_cluster: float  # mean over in-cluster pairs

    def to_json(self) -> dict[str, float]:
        return dict(vars(self))


def expected_routing(plan: RoutingPlan, vocab: int) -> RoutingExpectation:
    q, s, c = plan.spec.coupling, plan.spec.stay, plan.clusters
    pk = cluster_probabilities(plan)
    words = np.bincount(np.arange(FIRST_WORD, vocab) % plan.topics, minlength=plan.topics)
    r = float((stationary_topics(plan) / words).sum())
    same = q * q + (1 - q) ** 2 / (c - 1)
    other = 2 * q * (1 - q) / (c - 1) + (1 - q) ** 2 * (c - 2) / (c - 1) ** 2
    return RoutingExpectation(
        reuse_lag1=s * (r + (1 - r) * same) + (1 - s) * other,
        layer_coupling=same,
        hot_recall=float(pk.max(axis=1).mean()),
        lift_above_2x=(plan.spec.cluster_size - 1) / (plan.n_expert - 1),
        lift_in_cluster=float((1.0 / pk).mean()),
    )


@dataclass
class RoutingCheck:
    """Measured against expected, per statistic, with the tolerance each must meet."""

    expected: RoutingExpectation
    measured: RoutingExpectation
    pure_clusters: float  # share of (token, layer) whose k experts are one planted cluster
    cross_lift: float  # mean lift of pairs across clusters (0 expected)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "expected": self.expected.to_json(),
            "measured": self.measured.to_json(),
            "pure_clusters": self.pure_clusters,
            "cross_lift": self.cross_lift,
            "tolerance": dict(TOLERANCE),
            "failures": list(self.failures),
        }


def _lifts(trace: RoutingTrace, layer: int, cluster: np.ndarray) -> tuple[float, float]:
    tokens = trace.tokens
    co = coactivation(trace, layer).astype(np.float64)
    p = expert_counts(trace)[layer].astype(np.float64) / tokens
    with np.errstate(divide="ignore", invalid="ignore"):
        lift = (co / tokens) / np.outer(p, p)
    same = cluster[:, None] == cluster[None, :]
    np.fill_diagonal(same, False)
    cross = cluster[:, None] != cluster[None, :]
    return float(np.nanmean(lift[same])), float(np.nanmean(lift[cross]))


def check_routing(plan: RoutingPlan, vocab: int, trace: RoutingTrace) -> RoutingCheck:
    """Compare a capture of ``routing_prompts`` text (trace layers = ``plan.blocks``, BOS
    rows left out) with what the plan asked for."""
    if trace.k != plan.spec.cluster_size:
        raise BadInput(
            f"the expectations hold for top-k = cluster size; the trace has top-{trace.k}, "
            f"the clusters {plan.spec.cluster_size} experts"
        )
    cluster_of = plan.cluster_of()
    chosen = np.stack(
        [cluster_of[li][np.asarray(trace.ids[:, li])] for li in range(trace.layers)], axis=1
    )  # [tokens, layers, k] clusters of the chosen experts
    pure = float(np.mean(chosen.min(axis=2) == chosen.max(axis=2)))
    first = chosen[:, :, 0]
    follow = []
    for li in range(trace.layers - 1):
        predict = np.empty(plan.clusters, dtype=np.int64)
        predict[plan.topic_cluster[li]] = plan.topic_cluster[li + 1]
        follow.append(np.mean(first[:, li + 1] == predict[first[:, li]]))
    stats = routing_stats(trace).phases["all"]
    lifts = [_lifts(trace, li, cluster_of[li]) for li in range(trace.layers)]
    measured = RoutingExpectation(
        reuse_lag1=stats.mean_curve("reuse")[0],
        layer_coupling=float(np.mean(follow)) if follow else float("nan"),
        hot_recall=stats.mean("hot_k_share"),
        lift_above_2x=stats.mean("lift_above_2x"),
        lift_in_cluster=float(np.mean([a for a, _ in lifts])),
    )
    expected = expected_routing(plan, vocab)
    failures = []
    for name in ("reuse_lag1", "layer_coupling", "hot_recall", "lift_above_2x"):
        want, got = getattr(expected, name), getattr(measured, name)
        if np.isfinite(got) and abs(got - want) > TOLERANCE[name]:
            failures.append(f"{name} {got:.3f}, asked {want:.3f} ± {TOLERANCE[name]}")
    ratio = measured.lift_in_cluster / expected.lift_in_cluster
    if abs(ratio - 1) > TOLERANCE["lift_ratio"]:
        failures.append(
            f"lift in cluster {measured.lift_in_cluster:.2f}, asked "
            f"{expected.lift_in_cluster:.2f} (± {TOLERANCE['lift_ratio']:.0%})"
        )
    return RoutingCheck(
        expected=expected,
        measured=measured,
        pure_clusters=pure,
        cross_lift=float(np.mean([b for _, b in lifts])),
        failures=failures,
    )
