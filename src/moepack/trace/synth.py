"""Synthetic routing traces with planted structure, and the ground truth to check it against.

What is planted, per MoE layer (all knobs in ``TraceStructure``):

- **co-activation clusters**: the experts are split into ``clusters`` groups;
- **within-token locality**: each freshly chosen expert comes from the token's cluster with
  probability ``locality`` (else from anywhere), so a token's k experts mostly share a cluster;
- **persistence across tokens**: each of the previous token's k experts is kept with
  probability ``persistence`` and the rest are chosen afresh *outside* the previous set, so the
  mean overlap with the previous token is ``persistence`` itself (real Qwen routing: ~0.38);
  the token's cluster changes with probability ``1 - cluster_persistence`` per token;
- **coupling across layers**: whenever a layer's cluster changes, with probability
  ``layer_coupling`` it starts following the previous layer (cluster ``c`` at layer ``l``
  means cluster ``c`` at ``l + 1``) until its next change, otherwise it picks its own; so a
  token's cluster at one layer predicts the next layer's with probability about
  ``layer_coupling + (1 - layer_coupling) / clusters``;
- **a prefill part**: the first ``prefill_tokens`` tokens route wide: no persistence, locality
  ``prefill_locality``, a fresh cluster every token;
- **shuffled labels**: each layer's experts get a random slot order, so the checkpoint's own
  order (identity) is not already the clustered one — a layout tool has something to find.

The ground truth (which cluster each expert slot belongs to, per layer) is recorded in the
trace's provenance under ``"synth"`` and survives the native format; ``synth_truth(trace)``
reads it back. Everything is deterministic by ``seed`` and vectorised over tokens: a 100k-token
× 48-layer × top-8 trace over 128 experts takes seconds.
"""

from __future__ import annotations

import datetime as _dt
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import Keys

from ..errors import BadInput
from .core import RoutingTrace, id_dtype_for

if TYPE_CHECKING:
    from ..checkpoint.model import MoeModel

GENERATOR = "moepack.trace.synth v1"
_EXACT_CELLS = 1 << 21  # (cells x experts) per exact redraw batch: bounded memory
_MARK_CELLS = 1 << 24  # rows x experts of the redraw bitmap
_MAX_THREADS = 8
_LOCAL_TRIES = 12  # rejection-sampling candidates from the cluster
_FAR_TRIES = 8  # ... and from anywhere
_MAX_ROUNDS = 1000


@dataclass(frozen=True)
class SynthTruth:
    """The planted structure of a synthetic trace.

    ``cluster_of[layer, slot]`` is the cluster of expert ``slot`` (the checkpoint's own
    numbering, i.e. the ids in the trace) at trace layer ``layer``.
    """

    cluster_of: np.ndarray
    clusters: int
    params: dict[str, Any]

    def members(self, layer: int) -> list[np.ndarray]:
        """Expert slots of each cluster at ``layer``."""
        row = self.cluster_of[layer]
        return [np.flatnonzero(row == c) for c in range(self.clusters)]

    def clustered_order(self, layer: int) -> np.ndarray:
        """An ideal layout: slots sorted by cluster (new position -> old slot)."""
        return np.argsort(self.cluster_of[layer], kind="stable")


def _now() -> str:
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch and epoch.isdigit():
        when = _dt.datetime.fromtimestamp(int(epoch), tz=_dt.UTC)
    else:
        when = _dt.datetime.now(tz=_dt.UTC).replace(microsecond=0)
    return when.isoformat().replace("+00:00", "Z")


def _prob(name: str, value: float) -> float:
    v = float(value)
    if not 0.0 <= v <= 1.0:
        raise BadInput(f"synthetic trace: {name} must be between 0 and 1, got {value}")
    return v


def default_clusters(n_expert: int, top_k: int) -> int:
    """About three times top-k experts per cluster, and at least two clusters when a cluster
    can still hold a whole token's experts."""
    c = n_expert // (3 * top_k)
    if n_expert >= 2 * top_k:
        c = max(c, 2)
    return max(1, c)


def _sticky(keep: np.ndarray, fresh: np.ndarray) -> np.ndarray:
    """Values that persist: ``out[t] = out[t-1]`` where ``keep[t]``, else ``fresh[t]``
    (along axis 0; ``keep[0]`` is ignored). Vectorised: each position takes the fresh value of
    the last position at or before it that did not keep (a running maximum of indices)."""
    t = np.arange(keep.shape[0]).reshape((-1,) + (1,) * (keep.ndim - 1))
    src = np.maximum.accumulate(np.where(keep, 0, t), axis=0)
    return np.take_along_axis(fresh, src, axis=0)


class _Layer:
    """Draws one layer's expert choices (canonical labels: cluster c = a contiguous range)."""

    def __init__(
        self,
        rng: np.random.Generator,
        n: int,
        k: int,
        cl_start: np.ndarray,
        cl_size: np.ndarray,
        mark: np.ndarray,
    ) -> None:
        self.rng, self.n, self.k = rng, n, k
        self.cl_start, self.cl_size = cl_start, cl_size
        self.exclude_prev = n >= 2 * k  # otherwise a fresh set outside the previous one can't exist
        self.mark = mark  # scratch bitmap, reused across layers (fresh pages are slow to fault)

    def draw(self, cluster: np.ndarray, loc: np.ndarray) -> np.ndarray:
        """Independent draws for cells with token cluster ``cluster`` and locality ``loc``."""
        rng = self.rng
        local = rng.random(cluster.shape) < loc
        u = rng.random(cluster.shape)
        in_cluster = self.cl_start[cluster] + (u * self.cl_size[cluster]).astype(np.int32)
        anywhere = (u * self.n).astype(np.int32)
        return np.where(local, in_cluster, anywhere)

    def redraw(
        self, vals: np.ndarray, r: np.ndarray, j: np.ndarray, cluster: np.ndarray, loc: np.ndarray
    ) -> np.ndarray:
        """New experts for cells ``(r, j)`` (sorted by row) that avoid every value of their
        row, of the previous row (when excluded) and of the cells of the same row redrawn
        before them (slots in order), so a redrawn cell cannot clash where it is drawn."""
        n, mark = self.n, self.mark
        out = np.empty(r.size, dtype=np.int32)
        new_row = np.concatenate(([True], r[1:] != r[:-1]))
        row_id = np.cumsum(new_row) - 1
        uniq = r[new_row]
        rows_per = mark.size // n
        for a in range(0, uniq.size, rows_per):
            b = min(uniq.size, a + rows_per)
            c0, c1 = np.searchsorted(row_id, [a, b])
            ur = uniq[a:b]
            base = (np.arange(b - a, dtype=np.int32) * n)[:, None]
            marked = [(base + vals[ur]).ravel()]
            if self.exclude_prev:
                has = ur > 0
                marked.append((base[has] + vals[ur[has] - 1]).ravel())
            for m in marked:
                mark[m] = True
            cell_base = (row_id[c0:c1] - a).astype(np.int32) * n
            jj, cl, lo = j[c0:c1], cluster[c0:c1], loc[c0:c1]
            for slot in np.unique(jj):
                sel = np.flatnonzero(jj == slot)
                v = self._pick(cell_base[sel], cl[sel], lo[sel])
                mark[cell_base[sel] + v] = True
                marked.append(cell_base[sel] + v)
                out[c0 + sel] = v
            for m in marked:
                mark[m] = False
        return out

    def _pick(self, cell_base: np.ndarray, cluster: np.ndarray, loc: np.ndarray) -> np.ndarray:
        """One expert per cell not marked in the cell's bitmap row: from the cell's cluster
        with probability ``loc``, else from anywhere; uniform among the free candidates
        (rejection sampling, then an exhaustive draw for the rare cell still unplaced)."""
        rng, n, mark = self.rng, self.n, self.mark
        m = cluster.size
        size = self.cl_size[cluster][:, None]
        local = rng.random(m) < loc
        near = self.cl_start[cluster][:, None] + (
            rng.random((m, _LOCAL_TRIES), dtype=np.float32) * size
        ).astype(np.int32)
        near = np.minimum(near, (self.cl_start[cluster][:, None] + size - 1).astype(np.int32))
        far = rng.integers(0, n, (m, _FAR_TRIES), dtype=np.int32)
        cand = np.concatenate([near, far], axis=1)
        avail = ~mark[cell_base[:, None] + cand]
        avail[:, :_LOCAL_TRIES] &= local[:, None]
        first = np.argmax(avail, axis=1)
        rows = np.arange(m)
        v = cand[rows, first]
        stuck = np.flatnonzero(~avail[rows, first])
        step = max(1, _EXACT_CELLS // n)
        for a in range(0, stuck.size, step):
            idx = stuck[a : a + step]
            key = rng.random((idx.size, n))
            key[mark[cell_base[idx][:, None] + np.arange(n, dtype=np.int32)[None, :]]] = -1.0
            v[idx] = np.argmax(key, axis=1)
        return v

    def conflicts(
        self, vals: np.ndarray, reset: np.ndarray, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Freshly drawn cells (in ``rows``) that repeat an expert of their row or, when
        excluded, of the previous row. Kept cells win over fresh ones, and of two fresh
        duplicates the later slot is flagged. Returned sorted by row, then slot."""
        k = self.k
        m = rows.size
        cur = np.ascontiguousarray(vals[rows].T)  # [k, m]: one column per slot
        fresh = np.ascontiguousarray(reset[rows].T)
        kept = ~fresh
        bad = np.zeros((k, m), dtype=bool)
        for j in range(k):
            for j2 in range(k):
                if j2 != j:
                    eq = cur[j] == cur[j2]
                    if j2 > j:  # an earlier fresh slot keeps its value
                        eq &= kept[j2]
                    bad[j] |= eq
        if self.exclude_prev:
            prev = np.ascontiguousarray(vals[np.maximum(rows - 1, 0)].T)
            has = rows > 0
            for j in range(k):
                hit = np.zeros(m, dtype=bool)
                for j2 in range(k):
                    hit |= cur[j] == prev[j2]
                bad[j] |= hit & has
        bad &= fresh
        jj, ri = np.nonzero(bad)
        order = np.lexsort((jj, ri))
        return rows[ri[order]], jj[order]

    def run(self, cluster: np.ndarray, loc: np.ndarray, keep_p: np.ndarray) -> np.ndarray:
        rng, k = self.rng, self.k
        T = cluster.shape[0]
        reset = rng.random((T, k)) >= keep_p[:, None]
        reset[0] = True
        cl2 = np.broadcast_to(cluster[:, None], (T, k))
        loc2 = np.broadcast_to(loc[:, None], (T, k))
        fresh = self.draw(cl2, loc2)
        vals = _sticky(~reset, fresh)
        tt = np.arange(T)[:, None]
        nxt_reset = np.minimum.accumulate(np.where(reset, tt, T)[::-1], axis=0)[::-1]
        chain_end = np.vstack([nxt_reset[1:], np.full((1, k), T)])  # exclusive end of a chain
        rows = np.arange(T)
        for _round in range(_MAX_ROUNDS):
            r, j = self.conflicts(vals, reset, rows)
            if r.size == 0:
                return vals
            v = self.redraw(vals, r, j, cluster[r], loc[r])
            end = chain_end[r, j]
            lengths = end - r
            first = np.repeat(np.cumsum(lengths) - lengths, lengths)
            pos = np.repeat(r, lengths) + (np.arange(int(lengths.sum())) - first)
            vals[pos, np.repeat(j, lengths)] = np.repeat(v, lengths)
            touched = np.zeros(T, dtype=bool)
            touched[pos] = True
            touched[end[end < T]] = True
            rows = np.flatnonzero(touched)
        raise RuntimeError("synthetic trace: expert draws did not settle")  # pragma: no cover


def _shuffle(rng: np.random.Generator, canon_cluster: np.ndarray, clusters: int) -> np.ndarray:
    """A slot order (canonical expert -> slot) under which no cluster is a contiguous run."""
    n = canon_cluster.size
    perm = rng.permutation(n)
    if clusters < 2:
        return perm
    for _ in range(100):
        cluster_of_slot = np.empty(n, dtype=np.int64)
        cluster_of_slot[perm] = canon_cluster
        runs = 1 + int(np.count_nonzero(cluster_of_slot[1:] != cluster_of_slot[:-1]))
        if runs > clusters:
            return perm
        perm = rng.permutation(n)
    return perm  # pragma: no cover - only when every order is clustered


@dataclass(frozen=True)
class TraceStructure:
    """What ``synth_trace`` plants, per MoE layer (the module docstring says how each works):
    ``clusters`` of experts (default ``default_clusters(n_expert, top_k)``), the chance a
    token's experts come from its cluster (``locality``), keep the previous token's
    (``persistence``) or its cluster (``cluster_persistence``), the chance a layer follows the
    previous one (``layer_coupling``), and the prefill tokens' own ``prefill_locality``."""

    clusters: int | None = None
    locality: float = 0.8
    persistence: float = 0.4
    cluster_persistence: float = 0.9
    layer_coupling: float = 0.6
    prefill_locality: float = 0.1


def synth_trace(
    model: MoeModel | None = None,
    *,
    tokens: int = 4096,
    layers: int | None = None,
    n_expert: int | None = None,
    top_k: int | None = None,
    prefill_tokens: int = 0,
    structure: TraceStructure | None = None,
    weights: bool = False,
    seed: int = 0,
    block_map: list[int] | None = None,
    created: str | None = None,
) -> RoutingTrace:
    """A synthetic ``RoutingTrace`` with planted structure (see the module docstring).

    Sizes come from ``model`` (a ``MoeModel``: its MoE blocks, expert count, top-k; the trace is
    then bound to it by fingerprint and block map) or from ``layers``, ``n_expert`` and
    ``top_k``; giving both is allowed only when they agree. ``tokens`` is the whole trace, of
    which the first ``prefill_tokens`` are prefill; ``structure`` is what is planted (its
    defaults when not given). ``weights`` adds router weights (descending by slot,
    summing to 1 per row). ``created`` (ISO time) defaults to now, or ``SOURCE_DATE_EPOCH``.
    The ground truth is in ``provenance["synth"]``; read it with ``synth_truth``.
    """
    planted = structure or TraceStructure()
    clusters, locality, persistence = planted.clusters, planted.locality, planted.persistence
    cluster_persistence, layer_coupling = planted.cluster_persistence, planted.layer_coupling
    prefill_locality = planted.prefill_locality
    fingerprint = None
    provenance: dict[str, Any] = {"source": "moepack synth", "created": created or _now()}
    if model is not None:
        m_layers = len(model.blocks)
        if m_layers == 0:
            raise BadInput("the model has no MoE blocks to route to", model.path)
        m_n = model.n_expert
        if m_n < 1:
            raise BadInput("blocks of this model have different expert counts", model.path)
        m_k = model.top_k
        if m_k < 1:
            raise BadInput(
                f"the model does not say its top-k ({Keys.LLM.EXPERT_USED_COUNT.format(arch=model.architecture)})",
                model.path,
            )
        for name, given, have in (
            ("layers", layers, m_layers),
            ("n_expert", n_expert, m_n),
            ("top_k", top_k, m_k),
        ):
            if given is not None and int(given) != have:
                raise BadInput(f"synthetic trace: {name}={given}, but the model has {have}")
        if block_map is not None and list(block_map) != model.moe_block_indices:
            raise BadInput("synthetic trace for a model covers all its MoE blocks")
        layers, n_expert, top_k = m_layers, m_n, m_k
        block_map = model.moe_block_indices
        fingerprint = model.fingerprint
        model_name = model.shards[0].get(Keys.General.NAME) if model.shards else None
        provenance["model"] = str(model_name) if model_name else model.path.name
    if layers is None or n_expert is None or top_k is None:
        raise BadInput("synthetic trace: give a model, or layers, n_expert and top_k")
    T, L, n, k = int(tokens), int(layers), int(n_expert), int(top_k)
    if T < 1 or L < 1:
        raise BadInput("synthetic trace: tokens and layers must be >= 1")
    if n < 1 or not 1 <= k <= n:
        raise BadInput("synthetic trace: top_k must be between 1 and n_expert")
    P = int(prefill_tokens)
    if not 0 <= P <= T:
        raise BadInput(f"synthetic trace: prefill_tokens must be between 0 and {T}")
    C = default_clusters(n, k) if clusters is None else int(clusters)
    if not 1 <= C <= n:
        raise BadInput(f"synthetic trace: clusters must be between 1 and n_expert ({n})")
    p_loc = _prob("locality", locality)
    p_keep = _prob("persistence", persistence)
    p_stick = _prob("cluster_persistence", cluster_persistence)
    p_couple = _prob("layer_coupling", layer_coupling)
    p_ploc = _prob("prefill_locality", prefill_locality)
    seed = int(seed)
    if seed < 0:
        raise BadInput("synthetic trace: seed must be >= 0")

    sizes = np.full(C, n // C, dtype=np.int32)
    sizes[: n % C] += 1
    cl_start = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    canon_cluster = np.repeat(np.arange(C), sizes)
    is_prefill = np.arange(T) < P
    loc = np.where(is_prefill, p_ploc, p_loc)
    keep_p = np.where(is_prefill, 0.0, p_keep)
    stick = np.where(is_prefill, 0.0, p_stick)

    seeds = [s.spawn(2) for s in np.random.SeedSequence(seed).spawn(L)]
    # Cluster sequences first (layer l + 1 may copy layer l's), then the layers' expert draws,
    # which are independent, on a few threads (numpy releases the GIL in the heavy parts).
    cluster_seq = np.empty((L, T), dtype=np.int32)
    for layer in range(L):
        # Each layer's cluster is a sticky state: on a change (probability 1 -
        # cluster_persistence per token) it either follows the previous layer from then on
        # (probability layer_coupling) or picks a cluster of its own.
        rng = np.random.default_rng(seeds[layer][0])
        keep = rng.random(T) < stick
        own = _sticky(keep, rng.integers(0, C, size=T, dtype=np.int32))
        if layer > 0 and p_couple > 0:
            follow = _sticky(keep, rng.random(T) < p_couple)
            own = np.where(follow, cluster_seq[layer - 1], own)
        cluster_seq[layer] = own

    ids = np.empty((T, L, k), dtype=id_dtype_for(n))
    w_out = np.empty((T, L, k), dtype=np.float32) if weights else None
    cluster_of = np.empty((L, n), dtype=np.int64)

    def work(layer_list: list[int]) -> None:
        mark = np.zeros(min(T, max(1, _MARK_CELLS // n)) * n, dtype=bool)
        for layer in layer_list:
            rng = np.random.default_rng(seeds[layer][1])
            drawer = _Layer(rng, n, k, cl_start, sizes, mark)
            vals = drawer.run(cluster_seq[layer], loc, keep_p)
            perm = _shuffle(rng, canon_cluster, C)
            ids[:, layer, :] = perm[vals]
            cluster_of[layer, perm] = canon_cluster
            if w_out is not None:
                w = -np.log1p(-rng.random((T, k)))
                w = -np.sort(-w, axis=1)
                w_out[:, layer, :] = w / w.sum(axis=1, keepdims=True)

    workers = max(1, min(L, os.cpu_count() or 1, _MAX_THREADS))
    if workers == 1:
        work(list(range(L)))
    else:
        with ThreadPoolExecutor(workers) as pool:
            for f in [pool.submit(work, list(range(i, L, workers))) for i in range(workers)]:
                f.result()

    provenance["synth"] = {
        "generator": GENERATOR,
        "seed": seed,
        "params": {
            "tokens": T,
            "prefill_tokens": P,
            "clusters": C,
            "locality": p_loc,
            "persistence": p_keep,
            "cluster_persistence": p_stick,
            "layer_coupling": p_couple,
            "prefill_locality": p_ploc,
        },
        "cluster_of": cluster_of.tolist(),
    }
    return RoutingTrace(
        ids=ids,
        n_expert=n,
        weights=w_out,
        prefill_tokens=P,
        block_map=list(block_map) if block_map is not None else None,
        model_fingerprint=fingerprint,
        provenance=provenance,
    )


def synth_truth(trace: RoutingTrace) -> SynthTruth | None:
    """The planted structure recorded in a synthetic trace (None for other traces)."""
    info = trace.provenance.get("synth")
    if not isinstance(info, dict) or "cluster_of" not in info:
        return None
    cluster_of = np.asarray(info["cluster_of"], dtype=np.int64)
    if cluster_of.shape != (trace.layers, trace.n_expert):
        raise BadInput(
            f"synthetic ground truth has shape {cluster_of.shape}, the trace "
            f"{(trace.layers, trace.n_expert)}",
            trace.path,
        )
    params = dict(info.get("params", {}))
    clusters = int(params.get("clusters", int(cluster_of.max()) + 1))
    return SynthTruth(cluster_of=cluster_of, clusters=clusters, params=params)
