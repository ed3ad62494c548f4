"""The cost model: merged requests per token, read-through of gaps, the LRU cache, time on a
surface and the surface's two-parameter fit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moepack.checkpoint.model import MoeModel
from moepack.errors import BadInput
from moepack.layout.cost import (
    NO_SURFACE_NOTE,
    CostOptions,
    block_cost,
    fit_surface,
    layout_cost,
)
from moepack.layout.layout import place
from moepack.storage.surface import Surface, SurfaceCell

T_OP = 80e-6  # a device with 80 µs per request and 2 GB/s streaming
BW = 2e9
SIZES = [4096 * 2**i for i in range(10)]


def linear_surface() -> Surface:
    """Cells that follow ``time = t_op + size / BW`` exactly, at queue depth 1."""
    return Surface([SurfaceCell(s, 1, s / (T_OP + s / BW)) for s in SIZES], engine="pread")


def cost(path: Path, layout: str, ids: list[list[int]], **kw: int) -> tuple[int, int]:
    with MoeModel(path) as m:
        bp = place(m, layout).block(0)
        c = block_cost(bp, np.asarray(ids), CostOptions(**kw))
        return c.requests, c.bytes


def test_adjacent_slices_merge_even_across_tensors(qwen_path: Path) -> None:
    with MoeModel(qwen_path) as m:
        gate, up, down = m.block(0).weight_tensors
        assert up.entry.offset == gate.entry.offset + gate.entry.n_bytes  # tensors back to back
        s = gate.slice_bytes
    assert cost(qwen_path, "identity", [[2, 3]]) == (3, 6 * s)
    assert cost(qwen_path, "identity", [[2, 5]]) == (6, 6 * s)
    # expert 7's gate slice ends where expert 0's up slice begins
    assert cost(qwen_path, "identity", [[0, 7]]) == (4, 6 * s)
    assert cost(qwen_path, "expert-major", [[2, 3]]) == (1, 6 * s)
    assert cost(qwen_path, "expert-major", [[2, 5]]) == (2, 6 * s)
    assert cost(qwen_path, "fused", [[2, 5]]) == (4, 6 * s)


def test_merge_gap_reads_through_small_gaps_only(qwen_path: Path) -> None:
    with MoeModel(qwen_path) as m:
        s = m.block(0).weight_tensors[0].slice_bytes
    assert cost(qwen_path, "identity", [[2, 5]], merge_gap=2) == (3, 3 * 4 * s)
    assert cost(qwen_path, "identity", [[2, 6]], merge_gap=2) == (6, 6 * s)


def test_lru_cache_reads_only_misses(qwen_path: Path) -> None:
    ids = [[1, 2], [1, 2], [3, 1], [4, 5], [1, 2]]
    cold = cost(qwen_path, "expert-major", ids)
    assert cold[0] == 6  # one run per token, but experts 3 and 1 are apart
    with MoeModel(qwen_path) as m:
        bp = place(m, "expert-major").block(0)
        c = block_cost(bp, np.asarray(ids), CostOptions(cache=3))
        # misses: t0 {1,2}, t2 {3}, t3 {4,5}, t4 {2} (evicted by 4 and 5): one run each
        assert (c.hits, c.lookups) == (4, 10)
        assert c.requests == 4
        assert c.bytes == 6 * bp.bytes_per_expert


def test_the_cost_models_cache_is_the_replays_lru() -> None:
    """One LRU for analyse and replay: with one expert per token, where loading a token's
    experts together changes nothing, the cost model's misses are exactly the misses of the
    ``lru`` policy that replay runs."""
    from moepack.layout.cost import cache_misses
    from moepack.stream.simulate import run_layer
    from moepack.trace.cache_policy import POLICIES

    ids = np.random.default_rng(5).integers(0, 12, size=(400, 1))
    for capacity in (1, 3, 6, 12):
        rows, experts, hits = cache_misses(ids, capacity)
        missed = ~run_layer(POLICIES.get("lru"), ids, capacity, 12).hits[:, 0]
        assert hits == int((~missed).sum()) and 0 < hits < ids.size
        assert rows.tolist() == np.flatnonzero(missed).tolist()
        assert experts.tolist() == ids[missed, 0].tolist()


def test_fit_recovers_the_devices_t_op_and_bandwidth() -> None:
    fit = fit_surface(linear_surface(), 1)
    assert fit.t_op == pytest.approx(T_OP, rel=0.02)
    assert fit.bandwidth == pytest.approx(BW, rel=0.02)


def test_time_is_each_requests_own_size_on_the_surface(qwen_path: Path) -> None:
    surface = linear_surface()
    ids = np.asarray([[[2, 3], [0, 1]], [[2, 5], [6, 7]]])  # tokens x layers x k
    with MoeModel(qwen_path) as m:
        s = m.block(0).weight_tensors[0].slice_bytes
        ident = layout_cost(place(m, "identity"), ids, [0, 1], CostOptions(), surface)
        major = layout_cost(place(m, "expert-major"), ids, [0, 1], CostOptions(), surface)
    per = {n: n / surface.bandwidth(n, 1) for n in (s, 2 * s, 6 * s, 3 * s)}
    # identity, block 0: token 0 three 2-slice runs, token 1 six 1-slice runs
    assert ident.block(0).time == pytest.approx(3 * per[2 * s] + 6 * per[s])
    # expert-major, block 0: token 0 one 6-slice run, token 1 two 3-slice runs
    assert major.block(0).time == pytest.approx(per[6 * s] + 2 * per[3 * s])
    assert major.time_per_token is not None and ident.time_per_token is not None
    assert major.time_per_token < ident.time_per_token
    assert ident.fit is not None and not ident.notes


def test_without_surface_only_requests_and_bytes(qwen_path: Path) -> None:
    with MoeModel(qwen_path) as m:
        c = layout_cost(place(m, "identity"), np.zeros((3, 2, 2), np.int64) + [0, 1], [0, 1])
    assert c.time_per_token is None and c.notes == [NO_SURFACE_NOTE]
    assert c.requests_per_token == 6.0
    assert c.to_json()["time_per_token_us"] is None


def test_bad_options_and_empty_ranges_are_bad_input(qwen_path: Path) -> None:
    with MoeModel(qwen_path) as m:
        p = place(m, "identity")
        with pytest.raises(BadInput, match="`cache` must be 0 or more"):
            layout_cost(p, np.zeros((1, 2, 2), np.int64), [0, 1], CostOptions(cache=-1))
        with pytest.raises(BadInput, match="no tokens to cost"):
            layout_cost(p, np.zeros((0, 2, 2), np.int64), [0, 1])


def test_requests_are_timed_at_their_o_direct_widened_size(qwen_path: Path) -> None:
    from moepack.layout.cost import Requests, block_misses, token_requests, widened

    req = widened(Requests(np.array([0, 0]), np.array([100, 8192]), np.array([50, 4096])), 4096)
    assert req.offset.tolist() == [0, 8192] and req.length.tolist() == [4096, 4096]
    ids = np.asarray([[[2, 5], [1, 3]], [[0, 7], [4, 6]]])
    with MoeModel(qwen_path) as m:
        p = place(m, "identity")
        plain = layout_cost(p, ids, [0, 1], CostOptions(), linear_surface())
        direct = layout_cost(p, ids, [0, 1], CostOptions(align=4096), linear_surface())
        # one pass of the cache over the trace serves every layout alike
        shared = block_misses(ids, 2)
        em = place(m, "expert-major")
        assert layout_cost(em, ids, [0, 1], CostOptions(cache=2), None, shared).to_json() == (
            layout_cost(em, ids, [0, 1], CostOptions(cache=2)).to_json()
        )
        issued = token_requests(p.block(0), shared[0].rows, shared[0].experts)
    assert direct.requests_per_token == plain.requests_per_token
    assert direct.bytes_per_token > plain.bytes_per_token  # the file's slices are not aligned
    assert direct.time_per_token is not None and plain.time_per_token is not None
    assert direct.time_per_token > plain.time_per_token
    assert issued.length.size > 0
