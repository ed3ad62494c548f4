"""Verification the hard way: every single flipped byte of a repacked file must fail.

The file is small but complete: header, metadata (including moepack's provenance keys),
tensor infos, header padding, tensor data, padding between tensors and after the last one.
"""

from __future__ import annotations

import multiprocessing

import numpy as np

from moefixtures import flip_range, write_gguf
from moepack.checkpoint import MoeModel
from moepack.layout.plan import LayerPlan, Plan
from moepack.rewrite.repack import repack
from moepack.rewrite.verify import verify


def test_every_single_byte_flip_fails_verification(tmp_path):
    n, f, e = 32, 8, 4
    tensors = {
        "token_embd.weight": (6, n),
        "blk.0.attn_norm.weight": (n,),
        "blk.0.attn_q_norm.weight": (3,),  # 6 bytes: leaves padding before the next tensor
        "blk.0.ffn_gate_inp.weight": (e, n),
        "blk.0.ffn_gate_exps.weight": (e, f, n),
        "blk.0.ffn_up_exps.weight": (e, f, n),
        "blk.0.ffn_down_exps.weight": (e, n, f),
        "output_norm.weight": (5,),  # the file ends in padding
    }
    original = write_gguf(
        tmp_path / "o.gguf",
        "qwen3moe",
        tensors,
        {
            "general.name": "flip",
            "qwen3moe.expert_count": e,
            "qwen3moe.expert_used_count": 2,
            "qwen3moe.block_count": 1,
        },
        dtype=np.float16,
    )
    plan = Plan([LayerPlan(0, np.array([2, 0, 3, 1]))], MoeModel(original).fingerprint)
    repacked = repack(original, plan, tmp_path / "r.gguf").outputs[0]
    assert verify(original, repacked).ok
    shard = MoeModel(repacked).shards[0]
    size = repacked.stat().st_size
    # the file really has every kind of region
    assert shard.data_offset > shard.header_end  # header padding
    assert any(k.startswith("moepack.repack.perm") for k in shard.kv)
    assert size > shard.data_end  # trailing padding

    # every byte flipped whole; every single bit of the header (magic .. padding) on its own
    bits = tuple(1 << b for b in range(8))
    head = shard.data_offset
    jobs = []
    for lo, hi, masks in ((0, head, bits), (head, size, (0xFF,))):
        cuts = np.linspace(lo, hi, 3, dtype=int)
        jobs += [
            (str(original), str(repacked), int(a), int(b), masks)
            for a, b in zip(cuts[:-1], cuts[1:], strict=True)
        ]
    jobs.append((str(original), str(repacked), 0, head, (0xFF,)))
    with multiprocessing.get_context("fork").Pool(2) as pool:
        survivors = [i for part in pool.map(flip_range, jobs) for i in part]
    assert survivors == [], f"flips (offset, mask) {survivors[:10]} still verified"
