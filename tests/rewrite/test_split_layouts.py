"""Split checkpoints as people download them: split by size (as gguf-split and gguf-py's
writer split them), so a block's tensors fall in two shards. The layouts that pack a block
together (fused, pipeline) write the output's shards anew on block boundaries, near the
input's shard size or at ``split_max_size``; verify accounts for every byte shard set to shard
set, and undo gives the original's shards back byte for byte."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from gguf import GGUFValueType

from moefixtures import craft_metadata, grouped_plan, metadata_entries, run_cli, tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.experts import split_block_name
from moepack.checkpoint.provenance import pack_kv, read_provenance
from moepack.checkpoint.synth import synth_model
from moepack.errors import BadInput
from moepack.keys import REPACK_SHARDS
from moepack.rewrite.repack import repack
from moepack.rewrite.undo import undo
from moepack.rewrite.verify import verify

SPLIT = 200_000  # bytes per shard: block 2's expert matrices fall in two shards


def _split(
    folder: Path, arch: str = "deepseek2", layers: int = 3, split: int = SPLIT
) -> list[Path]:
    spec = tiny_spec(arch=arch, layers=layers, weight_type="Q8_0")
    return synth_model(folder / "s.gguf", spec, split_max_size=split).paths


def _blocks_by_shard(path: Path) -> dict[int, set[int]]:
    """Each ``blk.N`` block -> the shards its tensors are in."""
    with MoeModel(path) as m:
        where: dict[int, set[int]] = {}
        for i, shard in enumerate(m.shards):
            for t in shard.tensors:
                parts = split_block_name(t.name)
                if parts is not None:
                    where.setdefault(parts[0], set()).add(i)
        return where


def _same_shards(a: list[Path], b: list[Path]) -> bool:
    return len(a) == len(b) and all(
        x.read_bytes() == y.read_bytes() for x, y in zip(a, b, strict=True)
    )


@pytest.fixture
def src(tmp_path: Path) -> list[Path]:
    shards = _split(tmp_path)
    spread = [b for b, s in _blocks_by_shard(shards[0]).items() if len(s) > 1]
    assert len(shards) > 1 and spread, "the fixture must split a block across shards"
    return shards


@pytest.mark.parametrize(
    "layout, align", [("fused", 0), ("pipeline", 4096), ("reorder+fused+pipeline", 4096)]
)
def test_a_block_split_by_size_is_written_whole_in_one_shard(tmp_path, src, layout, align):
    with MoeModel(src[0]) as m:
        plan = grouped_plan(m, 3) if "reorder" in layout else None
        biggest = max(s.size - s.data_offset for s in m.shards)
    result = repack(src[0], plan, tmp_path / "o.gguf", layout=layout, alignment=align)
    outs = MoeModel(result.outputs[0]).shard_paths
    assert outs == result.outputs and len(outs) > 1
    assert outs[0].name.startswith("o-00001-of-")
    assert all(len(s) == 1 for s in _blocks_by_shard(outs[0]).values())  # cut between blocks
    with MoeModel(outs[0]) as r:
        assert all(len({t.shard for t in b.weight_tensors}) == 1 for b in r.blocks)
        for s in r.shards:  # near the input's size: no more tensor data than its largest shard
            assert s.size - s.data_offset <= biggest or len(_blocks_in(s)) == 1
        prov = read_provenance(r)
        assert prov is not None and prov.shards == [len(s) for s in _tensor_names(src)]
    checked = verify(src[0], outs[-1])  # any shard names the set
    assert checked.ok, checked.difference
    assert checked.shards == len(outs) and (checked.blocks_fused != []) == ("fused" in layout)
    back = undo(outs[0], tmp_path / "b.gguf").outputs
    assert [p.name for p in back] == [p.name.replace("s-", "b-") for p in src]
    assert _same_shards(src, back)


def _tensor_names(shards: list[Path]) -> list[list[str]]:
    with MoeModel(shards[0]) as m:
        return [[t.name for t in s.tensors] for s in m.shards]


def _blocks_in(shard: object) -> set[int]:
    names = [t.name for t in shard.tensors]  # type: ignore[attr-defined]
    return {p[0] for p in map(split_block_name, names) if p is not None}


def test_split_max_size_cuts_a_single_file_and_merges_a_split(tmp_path, src):
    one = synth_model(tmp_path / "one.gguf", tiny_spec(arch="deepseek2", layers=3)).paths[0]
    cut = repack(one, None, tmp_path / "c.gguf", layout="fused", split_max_size=60_000).outputs
    assert len(cut) > 2 and all(len(s) == 1 for s in _blocks_by_shard(cut[0]).values())
    with MoeModel(cut[0]) as r:  # gguf-split's bookkeeping: shard, count, tensors
        assert r.shards[1].kv.keys() >= {"split.no", "split.count", "split.tensors.count"}
    assert verify(one, cut[1]).ok
    back = undo(cut[0], tmp_path / "one-back.gguf").outputs
    assert back == [tmp_path / "one-back.gguf"] and _same_shards([one], back)

    merged = repack(src[0], None, tmp_path / "m.gguf", layout="fused", split_max_size=1 << 40)
    assert merged.outputs == [tmp_path / "m.gguf"]
    with MoeModel(merged.outputs[0]) as r:
        assert "split.count" not in r.shards[0].kv  # a single file again
    assert verify(src[1], merged.outputs[0]).ok
    assert _same_shards(src, undo(merged.outputs[0], tmp_path / "mb.gguf").outputs)


def test_a_split_without_a_packed_layout_keeps_its_shards(tmp_path, src):
    """Reordering and plain alignment move no block together: the shards stay as they are."""
    with MoeModel(src[0]) as m:
        plan = grouped_plan(m, 1)
    for layout, align in (("reorder", 0), ("reorder", 4096)):
        outs = repack(src[0], plan, tmp_path / f"k{align}.gguf", layout=layout, alignment=align)
        assert [p.name for p in outs.outputs] == [p.name.replace("s-", f"k{align}-") for p in src]
        with MoeModel(outs.outputs[0]) as r:
            prov = read_provenance(r)
            assert prov is not None and prov.shards is None
        assert verify(src[0], outs.outputs[0]).ok


def test_verify_fails_a_file_that_lies_about_the_original_shards(tmp_path, src):
    outs = repack(src[0], None, tmp_path / "o.gguf", layout="fused+pipeline").outputs
    counts = [len(s) for s in _tensor_names(src)]
    lie = [counts[0] - 1, counts[1] + 1]  # the same tensors, another cut
    for p in outs:  # every shard carries the provenance, and they must agree
        data = p.read_bytes()
        old = _u32_array(REPACK_SHARDS, counts)
        assert data.count(old) == 1
        p.write_bytes(data.replace(old, _u32_array(REPACK_SHARDS, lie)))
    result = verify(src[0], outs[0])
    assert not result.ok and result.difference is not None
    assert result.difference.what == "provenance" and "shards" in result.difference.message


def _u32_array(key: str, values: list[int]) -> bytes:
    name = key.encode()
    head = struct.pack("<Q", len(name)) + name + struct.pack("<IIQ", 9, 4, len(values))
    return head + struct.pack(f"<{len(values)}I", *values)


def test_a_split_whose_later_shard_holds_more_metadata_is_refused(tmp_path, src):
    """Only gguf-split's bookkeeping in the later shards can be put back as it was."""
    kvs = [raw for _, raw in metadata_entries(src[1])]
    extra = pack_kv("general.name", GGUFValueType.STRING, "second")
    tmp = tmp_path / "crafted.gguf"
    craft_metadata(src[1], tmp, [*kvs, extra])
    tmp.replace(src[1])
    with pytest.raises(BadInput, match="metadata beyond the split keys") as e:
        repack(src[0], None, tmp_path / "o.gguf", layout="fused", split_max_size=60_000)
    assert e.value.path == str(src[1])
    kept = repack(src[0], None, tmp_path / "k.gguf", layout="fused", split_max_size=SPLIT)
    assert len(kept.outputs) == len(src)  # as many shards: each keeps its own metadata
    assert verify(src[0], kept.outputs[0]).ok
    assert _same_shards(src, undo(kept.outputs[0], tmp_path / "kb.gguf").outputs)
    assert not list(tmp_path.glob("o*.gguf"))  # refused before anything was written


def test_cli_repack_split_verify_undo(capsys, tmp_path, src):
    out, back = tmp_path / "r.gguf", tmp_path / "b.gguf"
    code, text, err = run_cli(
        capsys, "repack", src[1], "--layout", "fused+pipeline", "--out", out, "--json", "-q"
    )
    assert code == 0, err
    written = [Path(p) for p in json.loads(text)["outputs"]]
    assert len(written) > 1 and written[0].name.startswith("r-00001-of-")
    code, text, err = run_cli(capsys, "verify", src[0], written[0], "-q")
    assert code == 0 and "OK" in text, err
    code, _, err = run_cli(capsys, "repack", written[1], "--undo", "--out", back, "-q")
    assert code == 0, err
    assert _same_shards(src, MoeModel(src[0].with_name("b-00001-of-00002.gguf")).shard_paths)
    small = tmp_path / "small.gguf"
    code, text, err = run_cli(
        capsys, "repack", src[0], "--split-max-size", "64K", "--out", small, "--json", "-q"
    )
    assert code == 0, err
    assert len(json.loads(text)["outputs"]) > len(src)
    code, _, err = run_cli(capsys, "repack", out, "--undo", "--split-max-size", "1M", "--out", back)
    assert code == 2 and "--undo takes no" in err


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["reorder+fused+pipeline", "fused"])
def test_llama_cpp_runs_a_split_fused_repack_as_the_original(tmp_path, capsys, layout):
    """check-dropin's four gates on a split download repacked fused (and pipelined): stock
    llama.cpp loads the shard set cut anew and computes what the original's shards compute."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
    spec = tiny_spec(arch="deepseek2", layers=3, experts=8, top_k=2, seed=5, weight_type="Q8_0")
    src = synth_model(tmp_path / "s.gguf", spec, split_max_size=SPLIT).paths
    assert any(len(s) > 1 for s in _blocks_by_shard(src[0]).values())  # a block split by size
    with MoeModel(src[0]) as m:
        plan = grouped_plan(m, 2) if "reorder" in layout else None
    outs = repack(src[0], plan, tmp_path / "r.gguf", layout=layout, alignment=4096).outputs
    assert len(outs) > 1 and all(len(s) == 1 for s in _blocks_by_shard(outs[0]).values())
    code, text, err = run_cli(
        capsys, "check-dropin", src[0], outs[0], "--tokens", "256", "--json", "-q"
    )
    assert code == 0, err
    result = json.loads(text)
    gates = {g["gate"]: g for g in result["gates"]}
    assert result["verdict"] == "PASS"
    assert gates["routing"]["same_order"] == 1.0
    assert gates["output"]["kl"] <= gates["output"]["envelope_kl"]
    if plan is not None:
        assert gates["routing"]["permutation"] == "recorded"
