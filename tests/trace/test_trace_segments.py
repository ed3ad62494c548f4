"""Prompt segments: a trace of several prompts knows which tokens are whose prefill and decode,
and every statistic, format and command takes them from the trace."""

from __future__ import annotations

import base64
import json
import struct
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from moefixtures import run_cli
from moepack.errors import BadInput
from moepack.trace import RoutingTrace, load_trace
from moepack.trace.core import PromptSegment
from moepack.trace.formats import save_trace
from moepack.trace.routing_stats import routing_stats
from moepack.trace.stats import expert_counts, overlap, summarize

# Prompt 0: 3 prefill tokens, 4 decode; prompt 1: 2 prefill, 5 decode (14 tokens).
SEGMENTS = [PromptSegment(0, 3, 4), PromptSegment(7, 2, 5)]
PREFILL0 = [[0, 1], [2, 3], [4, 5]]
PREFILL1 = [[0, 1], [2, 3]]


def two_prompt_trace(layers: int = 2) -> RoutingTrace:
    """Each prompt's decode repeats one expert pair ({6, 7}, then {4, 5}); its prefill walks
    other experts. Reuse at lag 1 inside each prompt's decode is exactly 1; any pair that
    bridged a prefill and a decode, or two prompts, would share nothing."""
    rows = PREFILL0 + [[6, 7]] * 4 + PREFILL1 + [[4, 5]] * 5
    ids = np.repeat(np.array(rows, dtype=np.uint8)[:, None, :], layers, axis=1)
    return RoutingTrace(
        ids=ids,
        n_expert=8,
        segments=SEGMENTS,
        block_map=list(range(layers)),
        provenance={"source": "two prompts"},
    )


def lru_hits(stream: list[list[int]], counted: np.ndarray, size: int) -> float:
    """A plain LRU cache of ``size`` experts over every access in token order; the hit rate
    of the accesses of the tokens ``counted`` marks."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for t, experts in enumerate(stream):
        for e in experts:
            hit = e in cache
            if hit:
                cache.move_to_end(e)
            else:
                cache[e] = None
                if len(cache) > size:
                    cache.popitem(last=False)
            if counted[t]:
                hits += hit
                total += 1
    return hits / total


def test_accessors_of_two_prompts():
    t = two_prompt_trace()
    assert (t.tokens, t.prompts, t.prefill_tokens, t.decode_tokens) == (14, 2, 5, 9)
    assert t.leading_prefill == 3 and t.prompt_segments == SEGMENTS
    decode = t.phase_mask("decode")
    assert decode.tolist() == [False] * 3 + [True] * 4 + [False] * 2 + [True] * 5
    assert t.token_prompts().tolist() == [0] * 7 + [1] * 7
    rows = t.phase_rows("decode")
    assert isinstance(rows, np.ndarray) and rows.tolist() == [3, 4, 5, 6, 9, 10, 11, 12, 13]
    assert t.phase_rows("all") == slice(0, 14)
    assert t.phase_runs("prefill") == [slice(0, 3), slice(7, 9)]
    assert t.phase_tokens("prefill") == 5
    with pytest.raises(BadInput, match="not contiguous"):
        t.phase_range("decode")
    split = t.prompt_split([1])
    assert split.train_prompts == [0] and split.held_out_prompts == [1]
    assert split.train_rows.tolist() == list(range(7))
    assert split.held_out_rows.tolist() == list(range(7, 14))
    with pytest.raises(BadInput, match="both sides"):
        t.prompt_split([0, 1])
    with pytest.raises(BadInput, match="do not exist"):
        t.prompt_split([2])
    s = t.summary()
    assert s["prompts"] == 2 and s["segments"] == [[0, 3, 4], [7, 2, 5]]


def test_one_segment_is_the_old_prefix_split():
    ids = two_prompt_trace().ids
    a = RoutingTrace(ids=ids, n_expert=8, prefill_tokens=3)
    b = RoutingTrace(ids=ids, n_expert=8, segments=[PromptSegment(0, 3, 11)])
    assert b.segments is None and b.prefill_tokens == 3 and b.summary() == a.summary()
    assert a.prompt_segments == [PromptSegment(0, 3, 11)] and "segments" not in a.summary()
    assert a.phase_rows("decode") == slice(3, 14)


@pytest.mark.parametrize(
    ("segments", "prefill", "needle"),
    [
        ([(0, 3, 4), (8, 2, 4)], 0, "starts at token 8, but the segments before it end at 7"),
        ([(0, 3, 4), (7, 2, 4)], 0, "cover 13 tokens, the trace has 14"),
        ([(0, 3, 4), (7, 0, 0), (7, 2, 5)], 0, "segment 1 has 0 prefill and 0 decode"),
        ([(0, 3, 4), (7, -1, 8)], 0, "segment 1 has -1 prefill"),
        ([(0, 3, 4), (7, 2, 5)], 3, "disagrees with the prompt segments, which hold 5"),
        ([(0, 3)], 0, "is not (start, prefill, decode)"),
    ],
)
def test_bad_segments_are_refused(segments, prefill, needle):
    ids = two_prompt_trace().ids
    with pytest.raises(BadInput, match=needle.replace("(", r"\(").replace(")", r"\)")):
        RoutingTrace(ids=ids, n_expert=8, segments=segments, prefill_tokens=prefill)


def test_decode_figures_stay_inside_each_prompt():
    t = two_prompt_trace()
    counts = expert_counts(t, "decode")
    assert counts[0].tolist() == [0, 0, 0, 0, 5, 5, 4, 4]
    np.testing.assert_array_equal(overlap(t, 1, "decode"), [1.0, 1.0])
    np.testing.assert_array_equal(overlap(t, 4, "decode"), [1.0, 1.0])  # prompt 1's run only
    assert np.isnan(overlap(t, 5, "decode")).all()  # no run of decode holds 6 tokens
    info = summarize(t, lag=2, window=4)
    assert info.phases["decode"].tokens == 9 and info.phases["prefill"].tokens == 5
    assert info.phases["decode"].overlap == 1.0
    assert info.phases["prefill"].overlap == 0.0  # pairs in one prefill share nothing

    stats = routing_stats(t)
    dec = stats.phases["decode"]
    assert dec.tokens == 9 and stats.phases["all"].tokens == 14
    assert dec.layers[0].reuse[:4] == [1.0, 1.0, 1.0, 1.0]
    assert np.isnan(dec.layers[0].reuse[4])
    stream = np.asarray(t.ids[:, 0, :]).tolist()
    mask = t.phase_mask("decode")
    for size in (1, 2, 3, 4, 8):
        assert dec.layers[0].lru_hit_rate[size - 1] == pytest.approx(lru_hits(stream, mask, size))
    allp = stats.phases["all"].layers[0]
    # reuse over all tokens: pairs within each prompt only (7 + 7 tokens: 6 + 6 pairs at lag 1)
    shared = [len(set(a) & set(b)) for a, b in zip(stream[1:7], stream[:6], strict=True)]
    shared += [len(set(a) & set(b)) for a, b in zip(stream[8:], stream[7:13], strict=True)]
    assert allp.reuse[0] == pytest.approx(sum(shared) / (12 * 2))


def test_moetrace_round_trip_carries_the_segments(tmp_path):
    t = two_prompt_trace()
    p = tmp_path / "t.moetrace"
    assert save_trace(t, p).dropped == []
    raw = p.read_bytes()
    assert struct.unpack("<I", raw[8:12]) == (2,)
    back = load_trace(p)
    assert back.prompt_segments == SEGMENTS and back.decode_tokens == 9
    np.testing.assert_array_equal(np.asarray(back.ids), np.asarray(t.ids))
    q = tmp_path / "again.moetrace"
    save_trace(back, q)
    assert q.read_bytes() == raw


def test_moetrace_version_1_keeps_the_first_prefix_and_says_so(tmp_path):
    p = tmp_path / "v1.moetrace"
    r = save_trace(two_prompt_trace(), p, version=1)
    assert any("prompt segments (2 prompts" in d for d in r.dropped)
    back = load_trace(p)
    assert back.segments is None and back.prefill_tokens == 3
    with pytest.raises(BadInput, match="cannot carry: prompt segments"):
        save_trace(two_prompt_trace(), tmp_path / "s.moetrace", version=1, strict=True)


def _with_segments(raw: bytes, segments: object, version: int = 2) -> bytes:
    """``raw`` (a .moetrace) with the header's segments replaced and both CRCs still right."""
    hlen = struct.unpack("<I", raw[12:16])[0]
    header = json.loads(raw[20 : 20 + hlen])
    if segments is None:
        header.pop("segments")
    else:
        header["segments"] = segments
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * ((-(20 + len(text))) % 64)
    if 20 + len(text) > 20 + hlen:  # keep the body where the header says it is
        pytest.skip("mutated header outgrew its padding")
    text += b" " * (hlen - len(text))
    fixed = raw[:8] + struct.pack("<II", version, hlen)
    return fixed + struct.pack("<I", zlib.crc32(text, zlib.crc32(fixed))) + text + raw[20 + hlen :]


@pytest.mark.parametrize(
    ("segments", "version", "needle"),
    [
        ([[0, 3, 4], [7, 2, 6]], 2, "cover 15 tokens, the trace has 14"),
        ([[0, 3, 4], [6, 3, 5]], 2, "starts at token 6, but the segments before it end at 7"),
        ([[0, 3, 11]], 2, "at least two [start, prefill, decode]"),
        ([[0, 3, 4], [7, 2]], 2, "at least two [start, prefill, decode]"),
        ([[0, 3, 4], [7, True, 5]], 2, "segments must be a non-negative integer"),
        ([[0, 3, 4], [7, -2, 5]], 2, "segments must be a non-negative integer"),
        ("0,3,4", 2, "'segments' has the wrong type"),
        (None, 2, "lacks 'segments'"),
        ([[0, 3, 4], [7, 2, 5]], 1, "unknown key(s) 'segments' (version 1 defines"),
    ],
)
def test_a_broken_segment_list_is_refused(tmp_path, segments, version, needle):
    p = tmp_path / "t.moetrace"
    save_trace(two_prompt_trace(), p)
    p.write_bytes(_with_segments(p.read_bytes(), segments, version))
    with pytest.raises(BadInput) as exc:
        load_trace(p)
    assert needle in str(exc.value)


# A .moetrace written by moepack before prompt segments existed (version 1): 4 tokens, 2
# layers, top-2 of 4, router weights, prefill 2, block map [1, 3], fingerprint ab12.
OLD_MOETRACE = (
    "eNqVj09Kw0AUxiftKdzJW7mYRTNTJAZsEOlOEcRdkTBN3rRDk0yYTGuLFDyAF0gP4AW8gO7TvcfxZSG4ceFjGL73"
    "++bP927vpg/3V9fTgDHGafvafp49w7yw2SotVQ3xLOTykcPc5juIydl5bCAORcQhc5kUEMNFPhpJDM+Bg9W6QQ+x"
    "FKM9B21dqaiD0qJ3KkM6YfI097saia5N5SNCpc2xSLWpFuhqR5A8NQ8FWVWK2xodkTGH2qE2RZF6u8KKQoge2Q1W"
    "qqKnKVxj165XoM3Wrx0CZWiWqv9sNuaCCxpkg64xtqIRODyhWSx901/9yaQLq7wUv0eJxvv96V/FgsGQFhsGbDBg"
    "wZD9s45dd3nsbiaHtp2QnhBKDu1JIqVMiCda64SxF9KvxFvq38h7J/ZBrEu+AaIPfCI="
)


def test_old_moetrace_files_read_and_write_as_before(tmp_path):
    raw = zlib.decompress(base64.b64decode(OLD_MOETRACE))
    old = tmp_path / "old.moetrace"
    old.write_bytes(raw)
    t = load_trace(old)
    assert t.segments is None and t.prompts == 1
    assert (t.tokens, t.prefill_tokens, t.decode_tokens) == (4, 2, 2)
    assert t.block_map == [1, 3] and t.model_fingerprint == "ab12"
    assert np.asarray(t.ids)[2].tolist() == [[3, 1], [0, 2]]
    assert t.phase_rows("decode") == slice(2, 4)
    again = tmp_path / "again.moetrace"
    save_trace(t, again)
    assert again.read_bytes() == raw


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("t.pmxtrace", "prompt segments (2 prompts; only the first prompt's prefill of 3"),
        ("t.txt", "prompt segments (2 prompts; only the first prompt's prefill of 3"),
        ("t.csv", "prompt segments (2 prompts; only the first prompt's prefill of 3"),
    ],
)
def test_formats_without_segments_report_them_lost(tmp_path, name, needle):
    t = two_prompt_trace()
    r = save_trace(t, tmp_path / name)
    assert any(needle in d for d in r.dropped), r.dropped
    back = load_trace(tmp_path / name, n_expert=8)
    assert back.segments is None and back.prefill_tokens == 3


def test_pmxtrace_v1_reports_segments_without_a_split(tmp_path):
    r = save_trace(two_prompt_trace(), tmp_path / "t.pmxtrace", version=1)
    assert "prompt segments (2 prompts, 5 prefill tokens)" in r.dropped


def test_mblt_keeps_segments_of_multi_token_prefills(tmp_path):
    r = save_trace(two_prompt_trace(), tmp_path / "t.mblt")
    assert not any("segments" in d for d in r.dropped)
    back = load_trace(tmp_path / "t.mblt")
    assert back.prompt_segments == SEGMENTS
    one = np.asarray(two_prompt_trace().ids)
    short = RoutingTrace(
        ids=one, n_expert=8, segments=[PromptSegment(0, 3, 4), PromptSegment(7, 1, 6)]
    )
    lost = save_trace(short, tmp_path / "s.mblt").dropped
    assert any("prompt segments" in d for d in lost)


def test_cli_info_and_stats_count_every_prompts_decode(tmp_path, capsys):
    p = tmp_path / "t.moetrace"
    save_trace(two_prompt_trace(), p)
    code, out, err = run_cli(capsys, "trace", "info", p, "--json")
    assert code == 0, err
    info = json.loads(out)
    assert (info["prompts"], info["decode_tokens"]) == (2, 9)
    assert info["phases"]["decode"]["tokens"] == 9
    code, out, err = run_cli(capsys, "trace", "stats", p, "--json")
    assert code == 0, err
    stats = json.loads(out)
    assert stats["phases"]["decode"]["tokens"] == 9
    assert stats["phases"]["decode"]["mean_reuse"][0] == 1.0
    code, out, err = run_cli(capsys, "trace", "info", p)
    assert code == 0, err
    assert "2 prompts" in out
    code, out, err = run_cli(capsys, "trace", "stats", p, "--plot", tmp_path / "plots")
    assert code == 0, err
    assert "in 2 prompts" in out
    assert sorted(f.name for f in (tmp_path / "plots").iterdir()) == [
        "coactivation-layer0.png",
        "lru-hit-rate.png",
        "popularity.png",
        "reuse.png",
    ]


def test_plan_from_decode_uses_every_prompts_decode(model_path: Path, tmp_path):
    from moepack.checkpoint import MoeModel
    from moepack.layout.coactivation_plan import plan_from_trace

    layers = len(MoeModel(model_path).moe_block_indices)
    t = two_prompt_trace(layers).replace(block_map=None)
    rows = [[0, 1]] * 3 + [[6, 7]] * 4 + [[0, 1]] * 2 + [[4, 5]] * 5
    ids = np.repeat(np.array(rows, dtype=np.uint8)[:, None, :], layers, axis=1)
    t = t.replace(ids=ids)
    with MoeModel(model_path) as m:
        outcome = plan_from_trace(m, t, phase="decode")
    assert outcome.trace_tokens == 9


def test_prompt_slice_keeps_whole_prompts_and_the_memory_map(tmp_path):
    p = tmp_path / "t.moetrace"
    save_trace(two_prompt_trace(), p)
    t = load_trace(p)
    second = t.prompt_slice(1, 2)
    assert isinstance(second.ids, np.memmap)
    assert second.segments is None and (second.prefill_tokens, second.decode_tokens) == (2, 5)
    np.testing.assert_array_equal(np.asarray(second.ids), np.asarray(t.ids[7:]))
    both = t.prompt_slice(0, 2)
    assert both.prompt_segments == SEGMENTS
    with pytest.raises(BadInput, match="not within 0..1"):
        t.prompt_slice(1, 3)
