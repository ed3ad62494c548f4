"""mbolt's MBLT v1 routing log: read (pruned prefill records included) and written."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from moepack.errors import BadInput
from moepack.trace import RoutingTrace, load_trace, save_trace
from moepack.trace.formats import detect_format

MAGIC = 0x544C424D


def _log(path: Path, n_expert: int, records: list[tuple[int, int, list[list[int]]]]) -> Path:
    out = struct.pack("<iii", MAGIC, 1, n_expert)
    for layer, k, rows in records:
        out += struct.pack("<iii", layer, k, len(rows))
        out += np.asarray(rows, dtype="<i4").tobytes()
    path.write_bytes(out)
    return path


def test_a_pruned_prefill_keeps_the_complete_token(tmp_path):
    """A prefill of 3 tokens over blocks 1 and 3 whose final layer routed only the last
    token, then two decode passes: 3 complete tokens, 2 pruned ones counted."""
    p = _log(
        tmp_path / "run.mblt",
        8,
        [
            (1, 2, [[0, 1], [2, 3], [4, 5]]),
            (3, 2, [[6, 7]]),
            (1, 2, [[1, 2]]),
            (3, 2, [[3, 4]]),
            (1, 2, [[5, 6]]),
            (3, 2, [[7, 0]]),
        ],
    )
    assert detect_format(p).NAME == "mblt"
    t = load_trace(p)
    assert t.block_map == [1, 3] and t.n_expert == 8 and t.k == 2
    np.testing.assert_array_equal(
        np.asarray(t.ids), [[[4, 5], [6, 7]], [[1, 2], [3, 4]], [[5, 6], [7, 0]]]
    )
    assert t.prefill_tokens == 1
    assert t.provenance["mblt"]["pruned_tokens"] == 2
    assert t.provenance["mblt"]["passes"] == [{"start": 0, "prefill": 1, "decode": 2}]


def test_round_trip_through_a_trace(tmp_path):
    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.permutation(16)[:4] for _ in range(3)]) for _ in range(50)])
    trace = RoutingTrace(
        ids=ids.astype(np.uint8), n_expert=16, prefill_tokens=20, block_map=[0, 2, 5]
    )
    res = save_trace(trace, tmp_path / "t.mblt")
    assert res.format == "mblt" and res.dropped == []
    back = load_trace(tmp_path / "t.mblt")
    np.testing.assert_array_equal(np.asarray(back.ids), ids)
    assert back.block_map == [0, 2, 5] and back.prefill_tokens == 20
    # one prefill record per layer (20 tokens), then 30 one-token passes
    assert (tmp_path / "t.mblt").stat().st_size == 12 + 3 * (12 + 20 * 16) + 30 * 3 * (12 + 16)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: struct.pack("<i", 0x12345678) + b[4:], "not an MBLT log"),
        (lambda b: b[:4] + struct.pack("<i", 2) + b[8:], "unsupported MBLT version 2"),
        (lambda b: b[:-4], "truncated"),
        (lambda b: b + b"\0\0", "trailing bytes"),
        (
            lambda b: b[:12] + struct.pack("<iii", 0, 2, 1) + struct.pack("<ii", 0, 9),
            "out of range",
        ),
        (lambda b: b[:12] + struct.pack("<iii", 0, 0, 1), "k must be"),
    ],
)
def test_bad_logs_are_one_line_errors(tmp_path, mutate, message):
    good = _log(tmp_path / "g.mblt", 8, [(0, 2, [[0, 1]]), (1, 2, [[2, 3]])]).read_bytes()
    bad = tmp_path / "b.mblt"
    bad.write_bytes(mutate(good))
    with pytest.raises(BadInput, match=message) as e:
        load_trace(bad, format="mblt")
    assert "\n" not in str(e.value)


def test_passes_must_route_the_same_layers(tmp_path):
    p = _log(tmp_path / "x.mblt", 8, [(0, 2, [[0, 1]]), (1, 2, [[2, 3]]), (0, 2, [[1, 2]])])
    with pytest.raises(BadInput, match="routes layers"):
        load_trace(p)


def test_every_cut_of_a_log_reads_or_is_refused(tmp_path):
    """A log cut anywhere ends in a clean error, or (at a record boundary) a shorter log."""
    records = [(0, 2, [[0, 1], [2, 3]]), (1, 2, [[4, 5], [6, 7]])] + [
        (la, 2, [[la, la + 1]]) for _ in range(3) for la in (0, 1)
    ]
    good = _log(tmp_path / "g.mblt", 8, records).read_bytes()
    cut = tmp_path / "c.mblt"
    for n in range(12, len(good)):
        cut.write_bytes(good[:n])
        try:
            t = load_trace(cut, format="mblt")
        except BadInput:
            continue
        assert 1 <= t.tokens <= 5


def test_decode_passes_after_a_prefill_are_read_in_blocks(tmp_path, monkeypatch):
    """The decode passes that follow a prompt's prefill take the vectorised path."""
    from moepack.trace.formats import mblt

    rng = np.random.default_rng(1)
    ids = np.stack([np.stack([rng.permutation(16)[:4] for _ in range(3)]) for _ in range(60)])
    trace = RoutingTrace(
        ids=ids.astype(np.uint8), n_expert=16, prefill_tokens=20, block_map=[0, 2, 5]
    )
    save_trace(trace, tmp_path / "t.mblt")
    taken: list[int] = []
    block = mblt._Passes.add_decode_block

    def counted(self, rows, k):
        taken.append(block(self, rows, k))
        return taken[-1]

    monkeypatch.setattr(mblt._Passes, "add_decode_block", counted)
    back = load_trace(tmp_path / "t.mblt")
    np.testing.assert_array_equal(np.asarray(back.ids), ids)
    assert back.prefill_tokens == 20
    assert sum(taken) == 40 * 3  # every decode record


def test_a_pass_of_more_layers_than_allowed_is_refused_as_it_grows(tmp_path, capsys):
    """A 4.8 MB log whose one pass names 300,000 layers was gathered whole (150 MB, 2 s)
    before the 4,096-layer limit refused it; now the record past the limit is refused."""
    from moefixtures import run_cli

    n = 300_000
    rec = np.zeros((n, 4), dtype="<i4")
    rec[:, 0], rec[:, 1], rec[:, 2] = np.arange(n), 1, 1
    path = tmp_path / "wide.mblt"
    path.write_bytes(struct.pack("<iii", 0x544C424D, 1, 8) + rec.tobytes())
    code, _, err = run_cli(capsys, "trace", "info", path)
    assert code == 2 and err.count("\n") == 1, err
    assert f"record at byte {12 + 16 * 4096:,}" not in err  # offsets are not grouped
    assert f"record at byte {12 + 16 * 4096}: the first forward pass routes more than 4,096" in err
    path.write_bytes(struct.pack("<iii", 0x544C424D, 1, 1 << 20))
    code, _, err = run_cli(capsys, "trace", "info", path)
    assert code == 2 and "n_expert=1,048,576; moepack accepts 1 to 131,072" in err
