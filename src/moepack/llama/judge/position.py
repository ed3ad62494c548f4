"""The position control of ``check-dropin``: ORIGINAL with its experts reordered.

An expert's position is not free in llama.cpp's arithmetic even when every byte moves with
it: the router's ``ggml_soft_max`` (``ffn_moe_probs``, over the ``n_expert`` logits of
``ffn_gate_inp``) sums its exponentials in the order the experts lie — on x86 in 16 (AVX-512)
or 8 (AVX2) float lanes per step, the steps in double — so another order rounds the
denominator differently, the router weights move by an ulp (``ffn_moe_probs`` and
``ffn_moe_weights_norm`` differ, the expert outputs ``ffn_moe_down`` do not), and the
activations' Q8_0/F16 rounding in the next matmuls amplifies that through the layers. Below 16
experts (8 on AVX2) the sum is all in double and exact: no change. Every softmax-routed family
has it; it decides a verdict where the other envelope is small: qwen3next / qwen35moe, whose
F16 KV cache exists only in every fourth layer (the delta-net layers keep F32 state).

So the output gate measures that change in the same run: this module writes ORIGINAL once
more into the scratch folder with a fixed pseudo-random order of every MoE block's experts
(inside the runs of experts llama.cpp's index rules allow, ``MoeBlock.constraints``), a
rewrite whose routing maps back exactly and whose only difference from ORIGINAL is where the
experts lie."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...checkpoint.model import MoeBlock, MoeModel
from ...layout.plan import LayerPlan, Plan
from ...progress import NULL_PROGRESS, ProgressSink
from ...rewrite.repack import repack

SEED = 20261202  # fixed: the control is the same file every run


@dataclass(frozen=True)
class PositionControl:
    """The reordered copy of ORIGINAL and, per MoE block, its slot -> ORIGINAL's expert; or,
    with no ``path``, why there is none (``skipped``)."""

    path: Path | None
    perms: dict[int, np.ndarray]
    skipped: str = ""


def control_permutation(block: MoeBlock, rng: np.random.Generator) -> np.ndarray:
    """A pseudo-random order of ``block``'s experts that keeps llama.cpp's index rules: shuffled
    inside runs of the smallest group size the rules name, the experts they fix left in place
    (the identity where the rules allow no move)."""
    n = block.n_expert
    if any(c.identity_only for c in block.constraints):
        return np.arange(n)
    size = min((c.group_size for c in block.constraints), default=n)
    fixed = max((c.fixed for c in block.constraints), default=0)
    perm = np.arange(n)
    for start in range(0, n - n % size, size):
        run = np.arange(max(start, fixed), start + size)
        perm[run] = rng.permutation(run)
    return perm if block.violation(perm) is None else np.arange(n)


def write_position_control(
    original: Path, folder: Path, progress: ProgressSink = NULL_PROGRESS
) -> PositionControl:
    """ORIGINAL reordered into ``folder``; none when no block's experts may move, or when the
    copy would not fit in ``folder`` (the verdict then rests on the F16-KV run alone, and
    says so)."""
    rng = np.random.default_rng(SEED)
    with MoeModel(original) as m:
        perms = {b.index: control_permutation(b, rng) for b in m.blocks}
        fingerprint, size = m.fingerprint, m.file_bytes
    moved = {b: p for b, p in perms.items() if not np.array_equal(p, np.arange(len(p)))}
    if not moved:
        return PositionControl(None, {}, "no expert may move")
    usage = shutil.disk_usage(folder)
    if usage.total and size > usage.free:
        return PositionControl(
            None, {}, f"a reordered copy needs {size:,} bytes, {usage.free:,} are free in {folder}"
        )
    plan = Plan([LayerPlan(b, p) for b, p in moved.items()], fingerprint)
    out = repack(original, plan, folder / "position-control.gguf", progress=progress)
    return PositionControl(out.outputs[0], moved)
