"""Planted routing: embeddings and router rows built so that llama.cpp's *actual* top-k shows
co-activation clusters, persistence along a topic, coupling across layers and skewed
popularity (``moepack synth --routing``).

The construction, per MoE layer ``l`` with ``C = n_expert / cluster_size`` clusters:

- every cluster ``k`` has a direction ``D[l, k]`` (random unit vectors, nearly orthogonal
  across all layers and clusters at these widths);
- the router row of every expert of cluster ``k`` is ``G * D[l, k]`` plus a small per-expert
  term, so a residual stream that points along ``D[l, k]`` routes to exactly that cluster's
  experts (top-k = cluster size picks the whole cluster);
- every token ``t`` has a topic ``t mod C``; at each layer it follows its topic's cluster
  ``topic_cluster[l, topic]`` (a share ``coupling`` of each topic's tokens, fixed per token
  and layer), else one of the other clusters; its embedding is ``sqrt(n) * (sum_l D[l, K[t, l]] / sqrt(L) +
  noise)``;
- attention outputs and FFN down-projections are damped (``DAMP``), so the residual stream
  still carries the embedding's directions at the last layer; router and selection biases
  are shrunk (``BIAS_SCALE``) so they do not outvote the planted logits.

Persistence and popularity come from the text: ``routing_prompts`` writes streams that keep
their topic with probability ``stay`` and otherwise move to another topic drawn with Zipf
weights ``(rank + 1) ** -skew``. What was asked is stored in the model under
``moepack.synth.routing``; ``expected_routing`` says what a capture should then measure.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import BadInput

if TYPE_CHECKING:
    from .synth import SynthSpec

DAMP = 0.05  # scale of the tensors that write into the residual stream
# Selection biases are shrunk (x BIAS_SCALE): a sigmoid gate saturates at the planted logits,
# and a bias of the usual size would reorder experts inside and outside the cluster.
ROUTER_BIASES = (".exp_probs_b.bias", ".ffn_gate_inp.bias")
BIAS_SCALE = 0.01
LOGIT_GAP = 8.0  # router logit of an expert of the token's cluster (others are ~N(0, 1))
TOKEN_NOISE = 0.3  # share of a token's embedding that is its own random direction
EXPERT_NOISE = 0.15  # per-expert part of a router row (orders experts inside a cluster)
FIRST_WORD = 259  # <unk> <s> </s> and 256 byte tokens come first
CJK_BASE = 0x4E00  # word pieces are "▁" + one CJK character: text round-trips exactly
CJK_CHARS = 0x9FFF - CJK_BASE + 1

_FIELDS = {"cluster": "cluster_size", "stay": "stay", "coupling": "coupling", "skew": "skew"}


@dataclass(frozen=True)
class RoutingSpec:
    """What the routing should look like (``cluster=8,stay=0.8,coupling=1,skew=1``)."""

    cluster_size: int = 8
    stay: float = 0.8
    coupling: float = 1.0
    skew: float = 0.0

    @classmethod
    def parse(cls, text: str, cluster: int | None = None) -> RoutingSpec:
        """``key=value`` pairs separated by commas; keys cluster, stay, coupling, skew.
        ``cluster`` is the cluster size when the text gives none (the CLI passes top-k)."""
        values: dict[str, Any] = {} if cluster is None else {"cluster_size": cluster}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, eq, value = part.partition("=")
            field = _FIELDS.get(key.strip())
            if not eq or field is None:
                raise BadInput(
                    f"routing spec {text!r}: expected key=value with keys "
                    f"{', '.join(_FIELDS)}, got {part!r}"
                )
            try:
                values[field] = int(value) if field == "cluster_size" else float(value)
            except ValueError:
                raise BadInput(f"routing spec {text!r}: {key} must be a number") from None
        return cls(**values)

    def check(self, n_expert: int, top_k: int, groups: int) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise BadInput(f"routing spec: {msg}")

        c = self.cluster_size
        need(c >= 1 and n_expert % c == 0, f"cluster {c} must divide the expert count {n_expert}")
        need(n_expert // c >= 2, "there must be at least 2 clusters")
        need(top_k <= c, f"top-k {top_k} must be at most the cluster size {c}")
        need(0.0 <= self.stay <= 1.0, "stay must be between 0 and 1")
        need(0.0 <= self.coupling <= 1.0, "coupling must be between 0 and 1")
        need(0.0 <= self.skew <= 8.0, "skew must be between 0 and 8")
        if groups > 1:
            need(
                (n_expert // groups) % c == 0,
                f"with {groups} expert groups the cluster must divide the group size "
                f"{n_expert // groups}",
            )


@dataclass(frozen=True)
class RoutingPlan:
    """The planted structure of one model, derived from its spec and seed."""

    spec: RoutingSpec
    blocks: tuple[int, ...]  # GGUF blocks with a router, in order (trace layer i = blocks[i])
    n_expert: int
    members: np.ndarray  # [layers, clusters, cluster_size] expert ids
    topic_cluster: np.ndarray  # [layers, topics] the cluster each topic routes to
    popularity: np.ndarray  # [topics] Zipf weights the prompts draw new topics with

    @property
    def clusters(self) -> int:
        return int(self.members.shape[1])

    @property
    def topics(self) -> int:
        return int(self.topic_cluster.shape[1])

    def cluster_of(self) -> np.ndarray:
        """``[layers, n_expert]``: each expert's cluster."""
        out = np.empty((len(self.blocks), self.n_expert), dtype=np.int64)
        for li in range(len(self.blocks)):
            for k in range(self.clusters):
                out[li, self.members[li, k]] = k
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self.spec),
            "blocks": list(self.blocks),
            "n_expert": self.n_expert,
            "members": self.members.tolist(),
            "topic_cluster": self.topic_cluster.tolist(),
            "popularity": [round(float(p), 9) for p in self.popularity],
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> RoutingPlan:
        spec = RoutingSpec(**{f: doc[f] for f in _FIELDS.values()})
        return cls(
            spec=spec,
            blocks=tuple(int(b) for b in doc["blocks"]),
            n_expert=int(doc["n_expert"]),
            members=np.asarray(doc["members"], dtype=np.int64),
            topic_cluster=np.asarray(doc["topic_cluster"], dtype=np.int64),
            popularity=np.asarray(doc["popularity"], dtype=np.float64),
        )


def _rng(seed: int, name: str) -> np.random.Generator:
    from .synth_values import named_rng

    return named_rng(seed, f"routing:{name}")


def router_blocks(spec: SynthSpec) -> tuple[int, ...]:
    """GGUF blocks whose family plan has a router that llama.cpp runs (dense leading blocks
    have none; multi-token-prediction blocks are never run, so nothing is planted there)."""
    runs = spec.layers - spec.family.nextn_layers(spec)
    out = []
    for t in spec.family.tensors(spec):
        if t.name.endswith(".ffn_gate_inp.weight") and int(t.name.split(".")[1]) < runs:
            out.append(int(t.name.split(".")[1]))
    return tuple(out)


@lru_cache(maxsize=4)
def routing_plan(spec: SynthSpec) -> RoutingPlan:
    """The clusters, topic maps and popularity of ``spec`` (which must have ``routing``)."""
    r = spec.routing
    if r is None:
        raise ValueError("spec has no routing")
    groups = spec.family.expert_groups(spec)
    e, c = spec.experts, r.cluster_size
    blocks = router_blocks(spec)
    n_clusters = e // c
    members = np.empty((len(blocks), n_clusters, c), dtype=np.int64)
    topic_cluster = np.empty((len(blocks), n_clusters), dtype=np.int64)
    for li, b in enumerate(blocks):
        rng = _rng(spec.seed, f"clusters:{b}")
        per = e // groups
        # scattered across the file (a planner has something to gather), never across groups
        order = np.concatenate([g * per + rng.permutation(per) for g in rng.permutation(groups)])
        members[li] = order.reshape(n_clusters, c)
        topic_cluster[li] = rng.permutation(n_clusters)
    ranks = _rng(spec.seed, "popularity").permutation(n_clusters)
    weights = (ranks + 1.0) ** -r.skew
    return RoutingPlan(r, blocks, e, members, topic_cluster, weights / weights.sum())


def _directions(spec: SynthSpec, plan: RoutingPlan) -> np.ndarray:
    rng = _rng(spec.seed, "directions")
    d = rng.standard_normal((len(plan.blocks), plan.clusters, spec.hidden))
    d /= np.linalg.norm(d, axis=-1, keepdims=True)
    return d.astype(np.float32)


def token_clusters(spec: SynthSpec, plan: RoutingPlan) -> np.ndarray:
    """``[vocab, layers]``: the cluster every token routes to at every MoE layer. Per layer
    and topic, exactly ``round(coupling * tokens of the topic)`` tokens (chosen at random)
    follow the topic's cluster; each of the others gets one of the other clusters, uniformly."""
    rng = _rng(spec.seed, "coupling")
    layers, c = len(plan.blocks), plan.clusters
    topic = np.arange(spec.vocab) % plan.topics
    own = plan.topic_cluster[:, topic].T  # [vocab, layers]
    out = (own + rng.integers(1, c, size=own.shape)) % c
    for li in range(layers):
        for z in range(plan.topics):
            members = np.flatnonzero(topic == z)
            follow = rng.permutation(members)[: round(plan.spec.coupling * len(members))]
            out[follow, li] = plan.topic_cluster[li, z]
    return out


def embedding_values(spec: SynthSpec) -> np.ndarray:
    """``token_embd`` ``[vocab, hidden]`` pointing every token along its clusters' directions."""
    plan = routing_plan(spec)
    d = _directions(spec, plan)
    k = token_clusters(spec, plan)
    n, layers = spec.hidden, len(plan.blocks)
    out = _rng(spec.seed, "token-noise").standard_normal((spec.vocab, n), dtype=np.float32)
    out *= np.float32(TOKEN_NOISE / math.sqrt(n))
    for li in range(layers):
        out += d[li, k[:, li]] / np.float32(math.sqrt(layers))
    out *= np.float32(math.sqrt(n))
    return out


def router_values(spec: SynthSpec, block: int) -> np.ndarray:
    """``ffn_gate_inp`` ``[n_expert, hidden]`` of ``block``: each row its cluster's direction."""
    plan = routing_plan(spec)
    li = plan.blocks.index(block)
    d = _directions(spec, plan)[li]
    cluster = plan.cluster_of()[li]
    n, layers = spec.hidden, len(plan.blocks)
    gain = np.float32(LOGIT_GAP * math.sqrt(layers * (1 + TOKEN_NOISE**2) / n))
    noise = _rng(spec.seed, f"router:{block}").standard_normal((spec.experts, n), dtype=np.float32)
    noise *= np.float32(EXPERT_NOISE / math.sqrt(n))
    rows: np.ndarray = gain * (d[cluster] + noise)
    return rows.astype(np.float32)


def damped(name: str) -> bool:
    """Tensors that write into the residual stream (scaled by ``DAMP`` with routing)."""
    return ".attn_output." in name or ".ssm_out." in name or ".ffn_down" in name


def routing_vocab(vocab: int) -> list[bytes]:
    """Word pieces for routing models: "▁" + one CJK character each, so that prompt text
    tokenises back to exactly the ids it was written from."""
    if vocab - FIRST_WORD > CJK_CHARS:
        raise BadInput(f"routing spec: vocab {vocab} is larger than {FIRST_WORD + CJK_CHARS}")
    return [("\u2581" + chr(CJK_BASE + i)).encode() for i in range(vocab - FIRST_WORD)]


def record(plan: RoutingPlan) -> str:
    return json.dumps(plan.to_json(), separators=(",", ":"))
