"""The layout family: registry, offset arithmetic of each layout and their combinations."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from moepack.checkpoint.model import MoeModel
from moepack.errors import BadInput
from moepack.layout.layout import LAYOUTS, LayoutOptions, LayoutPlacement, place, resolve_layout
from moepack.layout.plan import LayerPlan, Plan


def intervals(p: LayoutPlacement) -> list[tuple[int, int]]:
    out = []
    for b in p.blocks.values():
        for t in b.tensors:
            out += [(int(o), int(o) + t.slice_bytes) for o in t.offsets]
    return sorted(out)


def assert_disjoint_within(p: LayoutPlacement, size: int) -> None:
    iv = intervals(p)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(iv, iv[1:], strict=False))
    assert iv[-1][1] <= size


def reversing_plan(model: MoeModel) -> Plan:
    layers = [LayerPlan(b.index, np.arange(b.n_expert)[::-1].copy()) for b in model.blocks]
    return Plan(layers, model.fingerprint)


def test_registry_lists_every_layout_in_order() -> None:
    assert LAYOUTS.names() == ["identity", "reorder", "pipeline", "fused", "expert-major"]
    assert LAYOUTS.get("store").name == "expert-major"


def test_unknown_layout_names_the_known_ones() -> None:
    with pytest.raises(BadInput, match="unknown layout 'zigzag'; known: identity, reorder"):
        resolve_layout("identity+zigzag")


def test_identity_is_the_files_own_offsets(qwen_path: Path) -> None:
    with MoeModel(qwen_path) as m:
        p = place(m, "identity")
        for block in m.blocks:
            bp = p.block(block.index)
            assert [t.name for t in bp.tensors] == [
                t.name for t in sorted(block.weight_tensors, key=lambda t: t.entry.offset)
            ]
            for pt in bp.tensors:
                src = pt.sources[0]
                assert pt.offsets.tolist() == [src.slice_offset(e) for e in range(block.n_expert)]
        assert_disjoint_within(p, m.file_bytes)


def test_reorder_needs_a_plan_and_follows_its_permutation(qwen_path: Path) -> None:
    with MoeModel(qwen_path) as m:
        with pytest.raises(BadInput, match="needs a plan"):
            place(m, "reorder")
        plan = reversing_plan(m)
        p = place(m, "reorder", LayoutOptions(plan=plan))
        ident = place(m, "identity")
        for b in m.blocks:
            for pt, it in zip(p.block(b.index).tensors, ident.block(b.index).tensors, strict=True):
                # expert e now sits in slot n-1-e
                assert pt.offsets.tolist() == it.offsets[::-1].tolist()


def test_reorder_refuses_a_plan_for_another_model(qwen_path: Path) -> None:
    with MoeModel(qwen_path) as m:
        plan = reversing_plan(m)
        plan.model_fingerprint = "0" * 32
        with pytest.raises(BadInput, match="another model"):
            place(m, "reorder", LayoutOptions(plan=plan))


def test_pipeline_packs_in_execution_order(scattered: Callable[[bool], Path]) -> None:
    path = scattered(True)
    with MoeModel(path) as m:
        ident = place(m, "identity").block(0)
        pipe = place(m, "pipeline").block(0)
        assert [t.kind for t in ident.tensors] == ["down", "gate", "up"]
        assert [t.kind for t in pipe.tensors] == ["gate", "up", "down"]
        start = ident.region[0]
        cursor = start
        for t in pipe.tensors:
            assert t.offsets.tolist() == [cursor + e * t.slice_bytes for e in range(4)]
            cursor += 4 * t.slice_bytes
        # the dense tensors between up and the rest no longer widen the region
        assert pipe.region == (start, cursor)
        assert ident.region[1] > cursor
        assert_disjoint_within(place(m, "pipeline"), m.file_bytes)


def test_fused_makes_gate_and_up_one_slice(qwen_path: Path) -> None:
    with MoeModel(qwen_path) as m:
        p = place(m, "fused")
        bp = p.block(0)
        assert [t.kind for t in bp.tensors] == ["gate_up", "down"]
        gate_up = bp.tensors[0]
        gate = m.block(0).weight_tensors[0]
        assert gate_up.name == "blk.0.ffn_gate_up_exps"
        assert gate_up.slice_bytes == 2 * gate.slice_bytes
        assert bp.extents(np.array([3])).shape == (2, 2)  # one gate_up slice and one down
        assert_disjoint_within(p, m.file_bytes)


def test_fused_refuses_a_feed_forward_without_gate(scattered: Callable[[bool], Path]) -> None:
    path = scattered(False)
    with MoeModel(path) as m, pytest.raises(BadInput, match="block 0 has 0 gate and 1 up"):
        place(m, "fused")


def test_expert_major_gives_each_expert_one_run(qwen_path: Path) -> None:
    with MoeModel(qwen_path) as m:
        p = place(m, "expert-major")
        bp = p.block(1)
        for e in range(bp.n_expert):
            ext = bp.extents(np.array([e]))
            assert np.all(ext[1:, 0] == ext[:-1, 0] + ext[:-1, 1])  # adjacent
            assert int(ext[:, 1].sum()) == bp.bytes_per_expert
        # experts follow each other in slot order
        starts = [int(bp.extents(np.array([e]))[0, 0]) for e in range(bp.n_expert)]
        assert np.all(np.diff(starts) == bp.bytes_per_expert)
        assert_disjoint_within(p, m.file_bytes)


def test_combinations_compose_and_contradictions_are_refused(qwen_path: Path) -> None:
    spec = resolve_layout("reorder+fused+expert-major")
    assert (spec.permute, spec.fuse_gate_up, spec.arrangement) == (True, True, "expert-major")
    with pytest.raises(BadInput, match="cannot combine with 'pipeline'"):
        resolve_layout("pipeline+expert-major")
    with MoeModel(qwen_path) as m:
        plan = reversing_plan(m)
        p = place(m, spec, LayoutOptions(plan=plan))
        bp = p.block(0)
        # slot 0 holds the last expert, and one expert is still one run of two slices
        assert int(bp.extents(np.array([bp.n_expert - 1]))[0, 0]) == bp.region[0]
        assert bp.extents(np.array([0])).shape == (2, 2)
        assert_disjoint_within(p, m.file_bytes)


@pytest.mark.parametrize("layout", ["identity", "pipeline", "fused", "expert-major"])
def test_alignment_puts_every_slice_on_a_boundary(qwen_path: Path, layout: str) -> None:
    """Every slice of expert-major; in a tensor (as GGUF stores it) its start, and every slice
    whose size is a multiple of the alignment."""
    with MoeModel(qwen_path) as m:
        p = place(m, layout, LayoutOptions(alignment=4096))
        for b in p.blocks.values():
            for t in b.tensors:
                if layout == "expert-major" or t.slice_bytes % 4096 == 0:
                    assert np.all(t.offsets % 4096 == 0)
                else:
                    assert int(t.offsets.min()) % 4096 == 0
                    assert np.all(np.diff(np.sort(t.offsets)) == t.slice_bytes)
        iv = intervals(p)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(iv, iv[1:], strict=False))
