"""The routing a model with planted routing will show on given tokens, predicted in numpy from
what is recorded in the model (no llama.cpp): the trace ``synth --routing --trace-out``
writes, and an independent prediction a capture can be held against.

The set of experts of a (token, layer) is exact: the token's planted cluster (top-k equal to
the cluster size picks all of it). Inside the cluster, and for top-k smaller than the cluster,
the order is the family's gate (softmax or sigmoid, router and selection biases included) on
the router logits of the token's normalised embedding alone: attention and the damped FFNs
move the real logits slightly, so llama.cpp may order near-ties differently.
"""

from __future__ import annotations

import ast
import os
from typing import Any

import numpy as np

from ..checkpoint.archs import TensorPlan
from ..checkpoint.model import MoeModel
from ..checkpoint.routing import (
    RoutingSpec,
    embedding_values,
    router_values,
    routing_plan,
    token_clusters,
)
from ..checkpoint.synth import SynthSpec
from ..checkpoint.synth_values import tensor_values
from ..errors import BadInput
from ..keys import SYNTH_SPEC
from ..trace.core import RoutingTrace


def recorded_spec(model: str | os.PathLike[str]) -> SynthSpec:
    """The ``SynthSpec`` a synthetic model was written from (``moepack.synth.spec``)."""
    with MoeModel(model) as m:
        raw = m.shards[0].get(SYNTH_SPEC)
    if not isinstance(raw, str):
        raise BadInput(f"not a moepack synthetic model (no {SYNTH_SPEC})", model)
    try:
        fields: dict[str, Any] = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        raise BadInput(f"{SYNTH_SPEC} is not readable", model) from None
    if isinstance(fields.get("routing"), dict):
        fields["routing"] = RoutingSpec(**fields["routing"])
    return SynthSpec(**fields)


def _bias(spec: SynthSpec, names: dict[str, TensorPlan], name: str) -> np.ndarray:
    """A router or selection bias as written (zeros when the family has none)."""
    if name not in names:
        return np.zeros(spec.experts)
    t = names[name]
    return tensor_values(spec, t.name, t.shape, t.role).astype(np.float64)


def planted_ids(spec: SynthSpec, tokens: np.ndarray) -> np.ndarray:
    """``[len(tokens), moe layers, top_k]`` expert ids the planted routing gives ``tokens``."""
    if spec.routing is None:
        raise BadInput("the model has no planted routing")
    plan = routing_plan(spec)
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= spec.vocab):
        raise BadInput(f"token ids must be between 0 and {spec.vocab - 1}")
    clusters = token_clusters(spec, plan)[tokens]  # [T, L]
    emb = embedding_values(spec)[tokens].astype(np.float64)
    emb /= np.sqrt((emb * emb).mean(axis=1, keepdims=True))
    out = np.empty((len(tokens), len(plan.blocks), spec.top_k), dtype=np.int32)
    names = {t.name: t for t in spec.family.tensors(spec)}
    for li, block in enumerate(plan.blocks):
        members = plan.members[li][clusters[:, li]]  # [T, c]
        rows = router_values(spec, block).astype(np.float64)
        score = np.einsum("tcn,tn->tc", rows[members], emb)
        score += _bias(spec, names, f"blk.{block}.ffn_gate_inp.bias")[members]
        if spec.family.gating == "sigmoid":
            score = 1.0 / (1.0 + np.exp(-score))
        score += _bias(spec, names, f"blk.{block}.exp_probs_b.bias")[members]
        order = np.argsort(-score, axis=1, kind="stable")[:, : spec.top_k]
        out[:, li] = np.take_along_axis(members, order, axis=1)
    return out


def planted_trace(
    model: str | os.PathLike[str], tokens: np.ndarray, provenance: dict[str, Any] | None = None
) -> RoutingTrace:
    """The planted routing of ``tokens`` as a trace bound to ``model``."""
    spec = recorded_spec(model)
    ids = planted_ids(spec, tokens)
    with MoeModel(model) as m:
        fingerprint = m.fingerprint
    plan = routing_plan(spec)
    return RoutingTrace(
        ids=ids,
        n_expert=spec.experts,
        block_map=list(plan.blocks),
        model_fingerprint=fingerprint,
        provenance={"source": "moepack synth --routing (planted)", **(provenance or {})},
    )
