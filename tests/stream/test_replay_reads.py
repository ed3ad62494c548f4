"""``moepack replay``: the cache's misses read for real from a GGUF or a store, cold."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moefixtures import run_cli
from moepack.checkpoint.model import MoeModel
from moepack.errors import BadInput
from moepack.storage.modes import Mode, ModeUnsupported, open_file
from moepack.stream.budget import CacheBudget
from moepack.stream.command import replay_command
from moepack.stream.replay import ReplayOptions
from moepack.stream.simulate import run_layer
from moepack.trace import load_trace, synth_trace
from moepack.trace.cache_policy import POLICIES


def misses(trace_path: Path, slots: int, policy: str = "lru") -> int:
    t = load_trace(trace_path)
    p = POLICIES.get(policy)
    total = 0
    for layer in range(t.layers):
        ids = np.asarray(t.ids[:, layer, :])
        total += int((~run_layer(p, ids, slots, t.n_expert, p.fit(ids, 16, slots)).hits).sum())
    return total


def test_gguf_and_store_read_the_same_bytes_in_a_third_of_the_requests(
    streamed: dict[str, Path],
) -> None:
    opts = ReplayOptions(CacheBudget(slots=6), "lru", "threads", 4, Mode.BUFFERED)
    g = replay_command(streamed["model"], streamed["trace"], opts).replay
    s = replay_command(streamed["store"], streamed["trace"], opts).replay
    with MoeModel(streamed["model"]) as m:
        expert_bytes = sum(t.slice_bytes for t in m.blocks[0].weight_tensors)
    missed = misses(streamed["trace"], 6)
    assert g.requested_bytes == s.requested_bytes == missed * expert_bytes
    assert g.requests == 3 * s.requests == 3 * missed
    assert g.rates == s.rates and 0 < g.rates.lifetime < 1
    assert g.rates.decode is not None and g.rates.decode != g.rates.lifetime
    # the drop is confirmed, or the result says it was not (another process may hold pages)
    for r in (g, s):
        assert r.cold_confirmed is not False or any("page cache" in n for n in r.notes)
    assert g.seconds > 0 and g.gbps > 0 and g.tokens_per_second_bound is not None
    assert g.cache_bytes == 2 * 6 * expert_bytes
    assert g.peak_rss > g.cache_bytes


def test_a_fused_layout_reads_two_slices_per_expert(streamed: dict[str, Path]) -> None:
    opts = ReplayOptions(CacheBudget(slots=8), "belady", "pread", 1, Mode.BUFFERED)
    r = replay_command(streamed["model"], streamed["trace"], opts, layout="fused").replay
    assert r.layout == "fused" and r.requests == 2 * misses(streamed["trace"], 8, "belady")
    with pytest.raises(BadInput, match="apply to a GGUF source"):
        replay_command(streamed["store"], streamed["trace"], opts, layout="fused")


def test_direct_reads_and_prefetch(streamed: dict[str, Path]) -> None:
    try:
        open_file(streamed["store"], Mode.DIRECT).close()
    except ModeUnsupported:
        pytest.skip("this filesystem does not serve O_DIRECT")
    opts = ReplayOptions(CacheBudget(slots=6), "slru", "threads", 4, Mode.DIRECT, "sticky", 4)
    r = replay_command(streamed["store"], streamed["trace"], opts).replay
    p = r.prefetch
    assert p is not None and p.issued > 0 and 0 < p.useful <= p.misses
    assert 0 < p.precision <= 1 and 0 < p.usefulness <= 1
    # read-ahead reads are extra reads; covered misses need none of their own
    assert r.requests == misses(streamed["trace"], 6, "slru") - p.useful + p.issued
    assert r.device_bytes >= r.requested_bytes and r.cold_confirmed is True
    assert r.readahead_bytes > 0


def test_holdout_replays_the_last_prompt_learning_from_the_others(
    streamed: dict[str, Path],
) -> None:
    opts = ReplayOptions(CacheBudget(slots=8), "pinned-50", "pread", 1, Mode.BUFFERED, "markov")
    held = replay_command(streamed["store"], streamed["trace"], opts, holdout_prompts=True)
    r = held.replay
    assert r.tokens == 200 and r.notes == []  # nothing learned from the replayed tokens
    inside = replay_command(streamed["store"], streamed["trace"], opts, token_range="400:600")
    assert inside.replay.tokens == 200 and any("oracle" in n for n in inside.replay.notes)
    with pytest.raises(BadInput, match="drop `token_range`"):
        replay_command(
            streamed["store"], streamed["trace"], opts, token_range="0:9", holdout_prompts=True
        )


def test_a_trace_for_another_model_is_refused(streamed: dict[str, Path], tmp_path: Path) -> None:
    with MoeModel(streamed["other"]) as other:
        foreign = synth_trace(other, tokens=64, seed=1)
    from moepack.trace import save_trace

    save_trace(foreign, tmp_path / "foreign.moetrace")
    opts = ReplayOptions(CacheBudget(slots=6), mode=Mode.BUFFERED)
    for source in (streamed["model"], streamed["store"]):
        with pytest.raises(BadInput, match="fingerprint"):
            replay_command(source, tmp_path / "foreign.moetrace", opts)


def test_cli_replay_json_sweep_plot_and_bad_budget(
    streamed: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "sweep.png"
    code, out, err = run_cli(
        capsys,
        "replay",
        streamed["store"],
        streamed["trace"],
        "--slots",
        "5",
        "--mode",
        "buffered",
        "--qd",
        "2",
        "--sweep",
        "lru,belady",
        "--sweep-slots",
        "4,8,16",
        "--plot",
        png,
        "--json",
    )
    assert code == 0, err
    d = json.loads(out)
    assert d["kind"] == "store" and d["slots_per_layer"] == [5, 5]
    points = {(p["policy"], p["slots_per_layer"]): p for p in d["sweep"]}
    assert len(points) == 6
    for s in (4, 8, 16):
        assert (
            points[("lru", s)]["hit_rate"]["lifetime"]
            <= points[("belady", s)]["hit_rate"]["lifetime"]
        )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, err = run_cli(capsys, "replay", streamed["model"], streamed["trace"], "--cache", "64K")
    assert code == 2 and "minimum is 4 slots per layer" in err and "Traceback" not in err
    code, out, err = run_cli(capsys, "predict", streamed["trace"], "--json")
    assert code == 0, err
    assert json.loads(out)["split"]["held_out_prompts"] == 1


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_replay_source_is_checked_before_the_magic_is_sniffed(
    streamed: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    """Opening a FIFO to read the GGUF magic blocked forever; a child process, so a
    regression fails by timeout instead of hanging the session."""
    import os
    import subprocess
    import sys

    source = tmp_path / "src.gguf"
    if kind == "fifo":
        os.mkfifo(source)
    else:
        source.symlink_to("/dev/zero")
    code = "import sys; from moepack.cli.main import main; main(sys.argv[1:])"
    args = ["replay", str(source), str(streamed["trace"]), "--slots", "4"]
    r = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "not a model or expert store (moepack reads regular files only)" in lines[0]
