"""The expert prefetcher: ids to the file's own byte ranges, reads only what is not cached,
notices a changed file, and falls back from an engine that cannot serve the queue depth."""

from __future__ import annotations

import os

import numpy as np
import pytest

from moefixtures import tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.synth import synth_model
from moepack.errors import BadInput
from moepack.layout.plan import LayerPlan, Plan
from moepack.llama.prefetcher.prefetch import (
    ExpertRanges,
    FileRange,
    Prefetcher,
    ResidencySwitch,
    choose_engine,
    merge_ranges,
)
from moepack.llama.runtime.identity import FileIdentity, ModelChanged, check_unchanged
from moepack.pages import drop_cached
from moepack.rewrite.repack import repack
from moepack.storage.linux import PAGE_SIZE, cachestat


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("prefetch")
    spec = tiny_spec(layers=3, experts=16, top_k=4, hidden=256, expert_ffn=256, weight_type="Q8_0")
    return synth_model(d / "m.gguf", spec).paths[0]


def _cached_bytes(path, r: FileRange) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return cachestat(fd, r.offset, r.length).nr_cache * PAGE_SIZE
    finally:
        os.close(fd)


def _drop(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        drop_cached(fd)
    finally:
        os.close(fd)


def test_merge_joins_touching_ranges_only_within_a_shard():
    got = merge_ranges(
        [FileRange(0, 100, 50), FileRange(0, 0, 100), FileRange(0, 300, 10), FileRange(1, 150, 5)]
    )
    assert got == [FileRange(0, 0, 150), FileRange(0, 300, 10), FileRange(1, 150, 5)]


def test_ranges_are_the_slices_of_every_expert_matrix(model_path):
    with MoeModel(model_path) as m:
        layout = ExpertRanges(m)
        block = m.blocks[1]
        got = layout.ranges(block.index, [5, 2, 3, 2])
        expected = []
        for t in block.weight_tensors:
            expected.append(FileRange(t.shard, t.slice_offset(2), 2 * t.slice_bytes))
            expected.append(FileRange(t.shard, t.slice_offset(5), t.slice_bytes))
        assert got == merge_ranges(expected)
        # adjacent experts are one read per matrix; all experts cover each matrix whole
        assert len(layout.ranges(block.index, [2, 3])) <= len(block.weight_tensors)
        whole = layout.ranges(block.index, range(block.n_expert))
        assert sum(r.length for r in whole) == sum(t.entry.n_bytes for t in block.weight_tensors)
        assert layout.ranges(block.index, [-1, 99]) == []


def test_a_repacked_file_is_read_at_its_own_offsets(model_path, tmp_path):
    with MoeModel(model_path) as m:
        rng = np.random.default_rng(1)
        plan = Plan(
            [LayerPlan(b.index, rng.permutation(b.n_expert)) for b in m.blocks], m.fingerprint
        )
    out = repack(model_path, plan, tmp_path / "r.gguf").outputs[0]
    with MoeModel(out) as r:
        layout = ExpertRanges(r)
        b = r.blocks[0]
        down = next(t for t in b.weight_tensors if t.kind == "down")
        got = [x for x in layout.ranges(b.index, [7]) if x.offset >= down.entry.offset]
        assert got[0] == FileRange(0, down.slice_offset(7), down.slice_bytes)


def test_prefetch_reads_the_chosen_experts_and_only_once(model_path, tmp_path):
    copy = tmp_path / "cold.gguf"  # a file no other test has mapped (mapped pages stay cached)
    copy.write_bytes(model_path.read_bytes())
    model_path = copy
    with MoeModel(model_path) as m:
        p = Prefetcher(m, "threads", 4)
        block = m.blocks[0].index
    # Dropped once the header's mapping is gone: the read-around of parsing it may cover
    # experts, and pages still mapped cannot be dropped.
    _drop(model_path)
    layout = p.layout
    chosen = layout.ranges(block, [1, 6])
    other = layout.ranges(block, [11])
    assert all(_cached_bytes(model_path, r) == 0 for r in chosen)
    p.prefetch(block, [6, 1])
    for r in chosen:
        assert _cached_bytes(model_path, r) >= r.length - PAGE_SIZE
    assert all(_cached_bytes(model_path, r) < r.length for r in other)
    read = p.stats.bytes_read
    assert read >= sum(r.length for r in chosen)
    assert p.stats.reads >= len(chosen)
    p.prefetch(block, [1, 6])  # already resident: nothing more is read
    assert p.stats.bytes_read == read
    assert p.stats.bytes_resident >= sum(r.length for r in chosen)
    p.close()


def test_all_cached_block_costs_no_read(model_path):
    with open(model_path, "rb") as fh:
        while fh.read(1 << 20):
            pass
    with MoeModel(model_path) as m:
        p = Prefetcher(m, "pread", 1)
        for b in m.blocks:
            p.prefetch(b.index, range(b.n_expert))
        assert p.stats.bytes_read == 0
        assert p.stats.bytes_resident == p.stats.bytes_wanted > 0
        assert p.all_resident()
        p.close()


def test_a_changed_file_is_noticed(model_path, tmp_path):
    copy = tmp_path / "c.gguf"
    copy.write_bytes(model_path.read_bytes())
    ident = [FileIdentity.of(copy)]
    check_unchanged([copy], ident)
    os.utime(copy, ns=(0, 0))
    with pytest.raises(ModelChanged, match="changed since it was opened"):
        check_unchanged([copy], ident)
    copy.unlink()
    with pytest.raises(ModelChanged, match="disappeared"):
        check_unchanged([copy], ident)


def test_engine_choice_falls_back_or_refuses():
    assert choose_engine("threads", 8).warning is None
    c = choose_engine("pread", 4)
    assert (c.engine, c.queue_depth) == ("threads", 4)
    assert c.warning and "queue depth 1 only" in c.warning and "\n" not in c.warning
    with pytest.raises(BadInput, match="unknown engine"):
        choose_engine("nope", 1)
    with pytest.raises(BadInput, match="queue depth"):
        choose_engine("threads", 0)


def test_the_switch_turns_the_callback_off_only_while_everything_is_cached(model_path, tmp_path):
    copy = tmp_path / "s.gguf"
    copy.write_bytes(model_path.read_bytes())
    with MoeModel(copy) as m:
        p = Prefetcher(m, "threads", 2)
        blocks = [b.index for b in m.blocks]
    switch = ResidencySwitch(p, off_passes=3, max_wait=4)
    # all cached: one question, then three passes without the callback, then ask again
    assert [switch.callback_needed() for _ in range(4)] == [False] * 4
    assert switch.checks == 2 and switch.passes_off == 4
    _drop(copy)
    assert [switch.callback_needed() for _ in range(2)] == [False, False]  # still off
    assert switch.callback_needed() is True  # asked: not resident
    checks = switch.checks
    p.prefetch(blocks[0], [0, 1])  # a pass that read: no question
    assert switch.callback_needed() is True and switch.checks == checks
    # quiet passes on a file that stays partly cached: each "no" doubles the wait (2, 4, 4)
    asked = []
    for _ in range(16):
        before = switch.checks
        assert switch.callback_needed() is True
        asked.append(switch.checks - before)
    assert asked == [1, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0]
    p.close()
