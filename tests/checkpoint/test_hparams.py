"""Metadata that lies about the tensors is refused by every reader of a model file, in one line
naming the key (``checkpoint.hparams``), and llama.cpp refuses each such file too: a block
count of 2^31 - 1 or one the blk.N tensors do not fill, an embedding length of 0 or not
token_embd's width, an expert count the expert tensors do not have, head counts that do not
make the attention tensors, a per-layer array of another length than the block count."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFValueType

from moefixtures import craft_metadata, metadata_entries, run_cli, tiny_spec
from moepack.checkpoint import MoeModel
from moepack.checkpoint.provenance import pack_kv
from moepack.checkpoint.synth import synth_model
from moepack.errors import BadInput

U32 = GGUFValueType.UINT32
ARRAY = GGUFValueType.ARRAY

# (key, type, value, what the one line says); the model: 2 blocks, 8 experts, top-2, width 64,
# 2 query heads and 1 key/value head of 32
LIES = {
    "blocks-2^31-1": (
        "block_count",
        U32,
        2**31 - 1,
        "block_count is 2,147,483,647, past llama.cpp's 512",
    ),
    "blocks-more": ("block_count", U32, 3, "no tensor belongs to block 2"),
    "blocks-fewer": ("block_count", U32, 1, "tensors are for 2 block(s), blk.0 to blk.1"),
    "embedding-0": ("embedding_length", U32, 0, "embedding_length is 0 but token_embd.weight"),
    "embedding-other": ("embedding_length", U32, 96, "token_embd.weight is 64 wide"),
    "experts-fewer": ("expert_count", U32, 4, "expert_count is 4 but blk.0."),
    "experts-past-max": ("expert_count", U32, 4096, "past llama.cpp's 512 experts"),
    "heads-0": ("attention.head_count", U32, 0, "head_count is 0 for block 0"),
    "heads-other": ("attention.head_count", U32, 3, "head_count is 3 for block 0"),
    "kv-heads-other": ("attention.head_count_kv", U32, 2, "head_count_kv is 2 for block 0"),
    "kv-heads-array": ("attention.head_count_kv", ARRAY, [1, 1, 1], "has 3 entries for"),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_model(tmp_path_factory.mktemp("m") / "m.gguf", tiny_spec()).paths[0]


def lying(model: Path, dst: Path, case: str) -> tuple[Path, str, str]:
    """``model`` with one metadata entry replaced: (path, full key, needle)."""
    key, vtype, value, needle = LIES[case]
    full = f"qwen3moe.{key}"
    kvs = [pack_kv(full, vtype, value) if k == full else raw for k, raw in metadata_entries(model)]
    assert any(k == full for k, _ in metadata_entries(model)), full
    return craft_metadata(model, dst, kvs), full, needle


def test_the_untouched_model_reads(model: Path) -> None:
    with MoeModel(model) as m:
        assert m.block_count == 2 and m.n_expert == 8


@pytest.mark.parametrize("case", sorted(LIES))
def test_a_lie_is_one_line_naming_the_key(
    capsys: pytest.CaptureFixture[str], model: Path, tmp_path: Path, case: str
) -> None:
    bad, key, needle = lying(model, tmp_path / "lie.gguf", case)
    with pytest.raises(BadInput) as e:
        MoeModel(bad)
    assert key in str(e.value) and needle in str(e.value), str(e.value)
    assert "llama.cpp refuses the file" in str(e.value)
    for expected, args in [
        (2, ["inspect", bad]),
        (2, ["store", "build", bad, "--out", tmp_path / "s.moestore"]),
        (2, ["compare", model, bad]),
        (1, ["verify", model, bad]),  # verify never says OK on a file it cannot read
    ]:
        code, out, err = run_cli(capsys, *args)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == expected and len(lines) == 1, (args, err)
        assert lines[0].startswith("moepack: error: ") and key in lines[0] and needle in lines[0]
    assert not (tmp_path / "s.moestore").exists()


@pytest.mark.parametrize("case", ["blocks-2^31-1", "embedding-0"])
def test_fit_refuses_before_it_estimates(
    capsys: pytest.CaptureFixture[str], model: Path, tmp_path: Path, case: str
) -> None:
    """``fit`` said "needs 4096.0 TiB … verdict: streams" of a block count of 2^31 - 1, exit 0:
    it refuses the file now, before measuring or calibrating anything."""
    bad, key, needle = lying(model, tmp_path / "lie.gguf", case)
    code, out, err = run_cli(capsys, "fit", bad, "--memory", "8G", "-t", "1", "-q")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and out == "" and len(lines) == 1, err
    assert key in lines[0] and needle in lines[0]


LOAD = "import sys, llama_cpp; llama_cpp.Llama(sys.argv[1], n_ctx=64, verbose=False)"


def loads_in_llama_cpp(path: Path) -> bool:
    """Whether llama.cpp loads ``path`` (in a child: some refusals are an abort)."""
    proc = subprocess.run(
        [sys.executable, "-c", LOAD, str(path)], capture_output=True, text=True, timeout=300
    )
    return proc.returncode == 0


@pytest.mark.slow
def test_llama_cpp_refuses_every_lie(model: Path, tmp_path: Path) -> None:
    """The premise: each file refused here is one llama.cpp does not load (and the model
    they are made from, it does)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by ./dev test")
    assert loads_in_llama_cpp(model)
    loaded = [
        case
        for case in sorted(LIES)
        if loads_in_llama_cpp(lying(model, tmp_path / f"{case}.gguf", case)[0])
    ]
    assert loaded == []
