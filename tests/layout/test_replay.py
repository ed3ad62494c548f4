"""Physical replay: the cost model's requests read from the real file, cold."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from moepack.checkpoint.model import MoeModel
from moepack.errors import BadInput
from moepack.layout.cost import CostOptions, layout_cost
from moepack.layout.layout import place
from moepack.layout.replay import replay
from moepack.storage.linux import cachestat
from moepack.storage.modes import Mode, ModeUnsupported, open_file
from moepack.storage.surface import Surface, SurfaceCell


def routing(tokens: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack(
        [np.stack([rng.choice(8, 2, replace=False) for _ in range(2)]) for _ in range(tokens)]
    )


@pytest.mark.parametrize("layout", ["identity", "expert-major", "fused"])
def test_buffered_replay_reads_what_the_cost_model_counts(qwen_path: Path, layout: str) -> None:
    ids = routing(40)
    with MoeModel(qwen_path) as m:
        p = place(m, layout)
        predicted = layout_cost(p, ids, [0, 1])
        r = replay(m, p, ids, [0, 1], mode=Mode.BUFFERED)
        fd = os.open(qwen_path, os.O_RDONLY)
        try:
            resident = cachestat(fd).nr_cache
        except OSError:
            resident = None
        finally:
            os.close(fd)
    assert r.requests == round(predicted.requests_per_token * 40)
    assert r.requested_bytes == r.device_bytes == round(predicted.bytes_per_token * 40)
    assert r.cold_confirmed in (True, None)
    assert r.seconds > 0 and r.predicted_seconds is None
    if resident is not None:
        assert resident > 0  # the last token's reads really went through the page cache


def test_direct_replay_widens_to_the_devices_alignment(qwen_path: Path) -> None:
    try:
        open_file(qwen_path, Mode.DIRECT).close()
    except ModeUnsupported:
        pytest.skip("this filesystem does not serve O_DIRECT")
    surface = Surface([SurfaceCell(s, 1, s / (1e-4 + s / 1e9)) for s in (4096, 65536, 1 << 20)])
    ids = routing(20, seed=1)
    with MoeModel(qwen_path) as m:
        r = replay(
            m,
            place(m, "identity"),
            ids,
            [0, 1],
            cost=CostOptions(),
            surface=surface,
            mode=Mode.DIRECT,
        )
    assert r.device_bytes >= r.requested_bytes
    assert r.cold_confirmed is True and r.predicted_seconds is not None


def test_replay_refuses_an_unknown_engine_and_no_tokens(qwen_path: Path) -> None:
    with MoeModel(qwen_path) as m:
        p = place(m, "identity")
        with pytest.raises(BadInput, match="unknown engine 'warp'"):
            replay(m, p, routing(2), [0, 1], engine="warp", mode=Mode.BUFFERED)
        with pytest.raises(BadInput, match="no tokens to replay"):
            replay(m, p, routing(2)[:0], [0, 1], mode=Mode.BUFFERED)


def test_interleaved_replay_with_a_probe_beside_it(qwen_path: Path) -> None:
    from moepack.layout.replay import MeasureOptions, replay_layouts

    ids = routing(30, seed=2)
    with MoeModel(qwen_path) as m:
        placements = [place(m, "identity"), place(m, "expert-major")]
        measure = MeasureOptions(mode=Mode.BUFFERED, chunk_tokens=10, probe=True)
        got = replay_layouts(m, placements, ids, [0, 1], measure=measure)
        alone = [layout_cost(p, ids, [0, 1]) for p in placements]
    assert got.chunks == 3 and got.surface is not None
    issued = set()
    for r, cost in zip(got.results, alone, strict=True):
        # interleaving changes when reads happen, not which: the cost model's count holds
        assert r.requests == round(cost.requests_per_token * 30)
        assert len(r.chunk_seconds) == len(r.chunk_predicted) == 3
        assert sum(r.block_seconds.values()) == pytest.approx(r.seconds)
        assert r.predicted_seconds == pytest.approx(sum(r.chunk_predicted))
        assert r.lengths is not None
        issued |= set(r.lengths.tolist())
    # the probe read shadows of the replay's requests: its cells are sizes the replay issued
    assert {c.request_bytes for c in got.surface.cells} <= issued
    assert got.measured_speedup("identity") == 1.0
    with pytest.raises(BadInput, match="probe share"):
        no_share = MeasureOptions(mode=Mode.BUFFERED, probe=True, probe_share=0)
        replay_layouts(m, placements, ids, [0, 1], measure=no_share)
