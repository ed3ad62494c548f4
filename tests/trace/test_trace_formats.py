"""Every format: round trips across every pair, byte-exact re-writes, reported losses,
detection, and every kind of bad file."""

from __future__ import annotations

import itertools
import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from moepack.checkpoint import MoeModel
from moepack.errors import BadInput
from moepack.trace import RoutingTrace, load_trace, save_trace, synth_truth
from moepack.trace.core import (
    NEED_BLOCK_MAP,
    NEED_FORMAT,
    NEED_N_EXPERT,
    NEED_OUTPUT_FORMAT,
    TraceNeeds,
)
from moepack.trace.formats import FORMATS, detect_format

# (format, version, file name ending) for every writable variant
VARIANTS = [
    ("moetrace", 1, ".moetrace"),
    ("pmxtrace", 2, ".pmxtrace"),
    ("pmxtrace", 1, ".pmxtrace"),
    ("text", 1, ".txt"),
    ("routecsv", 1, ".csv"),
]
# which optional facts each variant keeps
KEEPS = {
    ("moetrace", 1): {"weights", "prefill", "block_map", "fingerprint", "provenance"},
    ("pmxtrace", 2): {"prefill"},
    ("pmxtrace", 1): set(),
    ("text", 1): {"prefill", "block_map", "fingerprint"},
    ("routecsv", 1): {"weights", "prefill", "block_map"},
}
IDS = [f"{f}v{v}" for f, v, _ in VARIANTS]


def save(trace: RoutingTrace, folder: Path, variant: tuple[str, int, str], stem: str = "t"):
    fmt, version, ext = variant
    return save_trace(trace, folder / f"{stem}{ext}", format=fmt, version=version)


def test_registry_lists_every_format():
    assert set(FORMATS) == {"moetrace", "pmxtrace", "text", "routecsv", "mblt"}
    for mod in FORMATS.values():
        for attr in ("NAME", "EXTENSIONS", "DESCRIPTION", "VERSIONS"):
            assert getattr(mod, attr)
        for fn in ("detect", "read", "write", "lost"):
            assert callable(getattr(mod, fn))


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_round_trip_keeps_what_the_format_carries(tmp_path, rich_trace, variant):
    fmt, version, _ = variant
    keeps = KEEPS[(fmt, version)]
    res = save(rich_trace, tmp_path, variant)
    back = load_trace(res.path, n_expert=8 if fmt == "pmxtrace" else None)
    assert np.array_equal(back.ids, rich_trace.ids)
    assert back.n_expert == 8
    assert back.prefill_tokens == (rich_trace.prefill_tokens if "prefill" in keeps else 0)
    if "weights" in keeps:
        assert back.weights is not None and rich_trace.weights is not None
        assert np.array_equal(back.weights, rich_trace.weights)
    else:
        assert back.weights is None
        assert "router weights" in res.dropped
    if "block_map" in keeps:
        assert back.block_map == [1, 3, 4]
    else:
        assert back.block_map is None
        assert any(d.startswith("block map") for d in res.dropped)
    if "fingerprint" in keeps:
        assert back.model_fingerprint == rich_trace.model_fingerprint
    else:
        assert back.model_fingerprint is None
        assert any("model fingerprint" in d for d in res.dropped)
    if "provenance" in keeps:
        assert back.provenance == rich_trace.provenance
        truth = synth_truth(back)
        assert truth is not None
        planted = synth_truth(rich_trace)
        assert planted is not None
        assert np.array_equal(truth.cluster_of, planted.cluster_of)
    else:
        assert any(d.startswith("provenance") for d in res.dropped)
    if "prefill" not in keeps:
        assert any("prefill" in d for d in res.dropped)
    if fmt == "moetrace":
        assert res.dropped == []


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_rewrite_is_byte_exact(tmp_path, rich_trace, variant):
    first = save(rich_trace, tmp_path, variant, "a")
    back = load_trace(first.path, n_expert=8 if variant[0] == "pmxtrace" else None)
    second = save(back, tmp_path, variant, "b")
    assert first.path.read_bytes() == second.path.read_bytes()
    assert first.bytes == second.bytes == first.path.stat().st_size


@pytest.mark.parametrize(("a", "b"), list(itertools.permutations(VARIANTS, 2)))
def test_every_format_pair(tmp_path, rich_trace, a, b):
    """A -> B keeps the ids and whatever both carry; B -> A -> B is byte-exact."""
    ka, kb = KEEPS[a[:2]], KEEPS[b[:2]]
    first = load_trace(save(rich_trace, tmp_path, a, "a").path, n_expert=8)
    if b[0] == "routecsv" and "block_map" not in ka:
        with pytest.raises(TraceNeeds, match="has no block map to say which blocks") as exc:
            save(first, tmp_path, b, "b")
        assert exc.value.need == NEED_BLOCK_MAP and str(exc.value).startswith(str(tmp_path))
        assert sorted(p.name for p in tmp_path.iterdir()) == [f"a{a[2]}"]
        first = first.replace(block_map=[1, 3, 4])
        ka = ka | {"block_map"}
    res_b = save(first, tmp_path, b, "b")
    second = load_trace(res_b.path, n_expert=8)
    assert np.array_equal(second.ids, rich_trace.ids)
    both = ka & kb
    assert second.prefill_tokens == (17 if "prefill" in both else 0)
    assert (second.weights is not None) == ("weights" in both)
    if "weights" in both:
        assert second.weights is not None and rich_trace.weights is not None
        assert np.array_equal(second.weights, rich_trace.weights)
    assert second.block_map == ([1, 3, 4] if "block_map" in both else None)
    fp_kept = "fingerprint" in both
    assert second.model_fingerprint == (rich_trace.model_fingerprint if fp_kept else None)
    # converting back and forth again gives the same B file
    if a[0] == "routecsv" and second.block_map is None:
        second = second.replace(block_map=[1, 3, 4])
    again = load_trace(save(second, tmp_path, a, "c").path, n_expert=8)
    if b[0] == "routecsv" and again.block_map is None:
        again = again.replace(block_map=[1, 3, 4])
    res_b2 = save(again, tmp_path, b, "d")
    if b[0] != "moetrace":  # moetrace keeps each source's provenance, which differs
        assert res_b2.path.read_bytes() == res_b.path.read_bytes()


def test_plain_trace_loses_nothing_anywhere(tmp_path, plain_trace):
    for variant in VARIANTS:
        trace = plain_trace
        if variant[0] == "routecsv":  # needs to know the blocks
            trace = plain_trace.replace(block_map=[0, 1, 2, 3])
        res = save(trace, tmp_path, variant, f"p{variant[1]}")
        assert res.dropped == [], variant
        back = load_trace(res.path, n_expert=20)
        assert np.array_equal(back.ids, plain_trace.ids)


def test_strict_refuses_lossy_writes(tmp_path, rich_trace):
    with pytest.raises(BadInput, match="pmxtrace v1 cannot carry: router weights"):
        save_trace(rich_trace, tmp_path / "x.pmxtrace", version=1, strict=True)
    assert list(tmp_path.iterdir()) == []
    save_trace(rich_trace, tmp_path / "x.moetrace", strict=True)


def test_pmxtrace_matches_the_peer_layout_exactly(tmp_path):
    """Bytes built by hand from the documented layout read correctly, and we write them back."""
    ids = np.array([[[12, 44, 7, 91], [3, 55, 8, 12]], [[1, 2, 3, 4], [9, 8, 7, 6]]], np.uint32)
    for version in (1, 2):
        head = struct.pack("<8sIIIIQ", b"PMXTRACE", version, 2, 100, 4, 2)
        if version == 2:
            head += struct.pack("<Q", 1)
        raw = head + ids.astype("<u4").tobytes()
        p = tmp_path / f"peer{version}.pmxtrace"
        p.write_bytes(raw)
        t = load_trace(p)
        assert np.array_equal(t.ids, ids)
        assert (t.n_expert, t.prefill_tokens) == (100, 1 if version == 2 else 0)
        out = save_trace(t, tmp_path / f"ours{version}.pmxtrace", version=version)
        assert out.path.read_bytes() == raw


def test_detection_by_magic_then_extension(tmp_path, plain_trace):
    plain_trace = plain_trace.replace(block_map=[4, 5, 6, 7])
    for fmt in ("moetrace", "pmxtrace", "routecsv"):
        p = tmp_path / f"{fmt}.bin"
        save_trace(plain_trace, p, format=fmt)
        assert fmt == detect_format(p).NAME
        assert np.array_equal(load_trace(p, n_expert=20).ids, plain_trace.ids)
    save_trace(plain_trace, tmp_path / "t.trace")
    assert detect_format(tmp_path / "t.trace").NAME == "text"
    (tmp_path / "odd.bin").write_bytes(b"0 0 1 2\n")
    with pytest.raises(TraceNeeds, match="format could not be detected: no known magic") as exc:
        load_trace(tmp_path / "odd.bin")
    assert exc.value.need == NEED_FORMAT and "--" not in str(exc.value)
    assert load_trace(tmp_path / "odd.bin", format="text", n_expert=4).ids.shape == (1, 1, 2)
    with pytest.raises(TraceNeeds, match="could not be told from the extension '.bin'") as exc:
        save_trace(plain_trace, tmp_path / "out.bin")
    assert exc.value.need == NEED_OUTPUT_FORMAT and "--" not in str(exc.value)
    with pytest.raises(BadInput, match="no such trace file"):
        load_trace(tmp_path / "missing.pmxtrace")


# ------------------------------------------------------------------ pmxtrace bad input
def pmx(version=2, layers=2, experts=8, k=2, tokens=3, prefill=0, body=None, magic=b"PMXTRACE"):
    head = struct.pack("<8sIIIIQ", magic, version, layers, experts, k, tokens)
    if version >= 2:
        head += struct.pack("<Q", prefill)
    if body is None:
        body = np.tile(np.arange(k, dtype="<u4"), tokens * layers)
    return head + np.asarray(body, dtype="<u4").tobytes()


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"PMXTR", "truncated: the pmxtrace magic and version needs 12 bytes, the file has 5"),
        (pmx()[:20], "truncated: the pmxtrace v2 header needs 40 bytes"),
        (pmx()[:-1], "truncated: the header declares 3 tokens × 2 layers × top-2 = 48 body"),
        (pmx() + b"\0\0\0\0", "trailing bytes"),
        (pmx(magic=b"PMXTRACX"), "not a pmxtrace file: magic is b'PMXTRACX'"),
        (pmx(version=3), "unsupported pmxtrace version 3"),
        (pmx(version=0), "unsupported pmxtrace version 0"),
        (pmx(layers=0, body=[]), "must all be non-zero"),
        (pmx(experts=0), "must all be non-zero"),
        (pmx(k=9, experts=8, body=[0] * 54), "top_k 9 exceeds n_experts 8"),
        (pmx(prefill=4), "4 prefill tokens of 3"),
        (pmx(body=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]), "expert id 8 is out of range for 8"),
        (pmx(body=[0, 1, 2, 3, 4, 4, 6, 7, 0, 1, 2, 3]), "token 1 layer 0: expert chosen twice"),
        (pmx(tokens=0, body=[]), "holds no tokens"),
    ],
)
def test_pmxtrace_bad_input(tmp_path, raw, needle):
    p = tmp_path / "bad.pmxtrace"
    p.write_bytes(raw)
    with pytest.raises(BadInput) as exc:
        load_trace(p)
    assert needle in str(exc.value)
    assert str(exc.value).startswith(str(p))


# ------------------------------------------------------------------ moetrace bad input
def native(tmp_path: Path, trace: RoutingTrace) -> bytes:
    return save_trace(trace, tmp_path / "good.moetrace").path.read_bytes()


PRE = 20  # magic, version, header length, header CRC


def header_of(raw: bytes) -> tuple[dict, int]:
    hlen = struct.unpack_from("<I", raw, 12)[0]
    return json.loads(raw[PRE : PRE + hlen]), hlen


def reseal(raw: bytes) -> bytes:
    """``raw`` with its header CRC made right again (to reach the checks behind it)."""
    hlen = struct.unpack_from("<I", raw, 12)[0]
    crc = zlib.crc32(raw[PRE : PRE + hlen], zlib.crc32(raw[:16]))
    return raw[:16] + struct.pack("<I", crc) + raw[PRE:]


def with_text(raw: bytes, text: bytes) -> bytes:
    """``raw`` with the JSON header replaced by ``text`` (padded to the old length), resealed."""
    _, hlen = header_of(raw)
    assert len(text) <= hlen
    return reseal(raw[:PRE] + text + b" " * (hlen - len(text)) + raw[PRE + hlen :])


def with_header(raw: bytes, change) -> bytes:
    header, _ = header_of(raw)
    change(header)
    return with_text(raw, json.dumps(header, sort_keys=True, separators=(",", ":")).encode())


def test_moetrace_layout(tmp_path, rich_trace):
    raw = native(tmp_path, rich_trace)
    assert raw[:8] == b"MOETRACE" and struct.unpack_from("<I", raw, 8)[0] == 1
    header, hlen = header_of(raw)
    assert header["shape"] == [240, 3, 2] and header["id_dtype"] == "uint8"
    assert header["body"]["offset"] == PRE + hlen and header["body"]["offset"] % 64 == 0
    crc = struct.unpack_from("<I", raw, 16)[0]
    assert crc == zlib.crc32(raw[PRE : PRE + hlen], zlib.crc32(raw[:16]))
    assert header["weights"]["offset"] % 64 == 0
    assert len(raw) == header["body"]["offset"] + header["body"]["bytes"]
    body = raw[header["body"]["offset"] :]
    assert np.array_equal(
        np.frombuffer(body[: 240 * 6], np.uint8).reshape(240, 3, 2), rich_trace.ids
    )


def test_moetrace_id_dtype_is_the_smallest(tmp_path):
    for n, dt in ((256, "uint8"), (257, "uint16"), (70000, "uint32")):
        t = RoutingTrace(ids=np.array([[[0, n - 1]]], dtype=np.uint32), n_expert=n)
        raw = save_trace(t, tmp_path / f"{n}.moetrace").path.read_bytes()
        assert header_of(raw)[0]["id_dtype"] == dt
        assert np.array_equal(load_trace(tmp_path / f"{n}.moetrace").ids, t.ids)


def test_moetrace_every_body_byte_is_checksummed(tmp_path, rich_trace):
    raw = native(tmp_path, rich_trace)
    header, _ = header_of(raw)
    start = header["body"]["offset"]
    p = tmp_path / "flip.moetrace"
    for pos in (start, start + 700, header["weights"]["offset"] - 1, len(raw) - 1):
        bad = bytearray(raw)
        bad[pos] ^= 0x01
        p.write_bytes(bytes(bad))
        with pytest.raises(BadInput, match="checksum mismatch"):
            load_trace(p)


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda r: r[:10], "truncated: the moetrace magic, version, header length and CRC needs"),
        (lambda r: b"MOETRACX" + r[8:], "not a moetrace file"),
        (lambda r: r[:8] + struct.pack("<I", 3) + r[12:], "unsupported moetrace version 3"),
        (lambda r: r[:12] + struct.pack("<I", 10**8) + r[16:], "truncated: the header declares"),
        (lambda r: r[:12] + struct.pack("<I", 64) + r[16:], "header checksum mismatch"),
        (lambda r: r[:16] + b"\0\0\0\0" + r[20:], "header checksum mismatch"),
        (lambda r: r[:-3], "truncated: the header declares a body of"),
        (lambda r: r + b"\0", "trailing bytes"),
        (lambda r: reseal(r[:PRE] + b"{nope" + r[PRE + 5 :]), "moetrace header is not valid JSON"),
        (lambda r: with_header(r, lambda h: h.update(n_expert=4)), "out of range for 4 experts"),
        (lambda r: with_header(r, lambda h: h.update(id_dtype="int8")), "id_dtype 'int8'"),
        (lambda r: with_header(r, lambda h: h.update(shape=[240, 3])), "shape must be"),
        (lambda r: with_header(r, lambda h: h.pop("n_expert")), "header lacks 'n_expert'"),
        (lambda r: with_header(r, lambda h: h.update(prefill_tokens=241)), "prefill of 241"),
        (lambda r: with_header(r, lambda h: h.update(format="other")), "says format 'other'"),
        (lambda r: with_header(r, lambda h: h.update(block_map=[0, "x", 2])), "list of integers"),
        (lambda r: with_header(r, lambda h: h.update(block_map=[0, 1])), "block map has 2"),
        (lambda r: with_header(r, lambda h: h.update(version=True)), "says format 'moetrace'"),
        (lambda r: with_header(r, lambda h: h.update(id_dtype="uint16")), "not the one for 8"),
        (lambda r: with_header(r, lambda h: h["body"].update(crc32="ABCDEF01")), "8 lowercase"),
        (lambda r: with_header(r, lambda h: h["body"].update(extra=1)), "unknown key(s) 'extra'"),
        (lambda r: with_header(r, lambda h: h["weights"].pop("dtype")), "lacks 'dtype'"),
        (lambda r: with_header(r, lambda h: h.update(weights=[])), "null or an object"),
    ],
)
def test_moetrace_bad_input(tmp_path, rich_trace, mutate, needle):
    raw = native(tmp_path, rich_trace)
    p = tmp_path / "bad.moetrace"
    p.write_bytes(mutate(raw))
    with pytest.raises(BadInput) as exc:
        load_trace(p)
    assert needle in str(exc.value)


def test_moetrace_every_header_bit_flip_is_an_error(tmp_path, rich_trace):
    """Flip each bit of everything before the body (magic, version, header length, header CRC,
    JSON header and its padding) in turn: every flip is a BadInput, none reads as a trace."""
    # every optional fact present, the provenance kept short (the synthetic ground truth is
    # just more JSON): 384 bytes before the body, 3072 flips
    small = rich_trace.replace(provenance={"source": "test", "notes": ["n"]})
    raw = native(tmp_path, small)
    header, hlen = header_of(raw)
    start = header["body"]["offset"]
    assert start == PRE + hlen and header["model_fingerprint"] and header["block_map"]
    assert header["weights"] and header["prefill_tokens"] and header["provenance"]
    shm = Path("/dev/shm")
    folder = shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    p = folder / f"moepack-test-flip-{os.getpid()}.moetrace"
    read_anyway = []
    try:
        for pos in range(start):
            for bit in range(8):
                bad = bytearray(raw)
                bad[pos] ^= 1 << bit
                p.write_bytes(bad)
                try:
                    load_trace(p)
                except BadInput:
                    continue
                read_anyway.append((pos, bit))
    finally:
        p.unlink(missing_ok=True)
    assert read_anyway == [], f"{len(read_anyway)} of {start * 8} header bit flips read fine"


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        # what single-bit flips did before the header had a checksum: now refused on their own
        ((b'"model_fingerprint"', b'"lodel_fingerprint"'), "lacks 'model_fingerprint'"),
        ((b'"block_map"', b'"blockmap" '), "lacks 'block_map'"),
        ((b'"format":', b'"format2":1,"format":'), "unknown key(s) 'format2'"),
        ((b'{"block_map"', b'{"n_expert":9,"block_map"'), "'n_expert' appears twice"),
    ],
)
def test_moetrace_header_keys_are_exact(tmp_path, rich_trace, edit, needle):
    """Behind a valid header checksum, a missing, renamed, unknown or repeated key is still an
    error: nothing is defaulted or ignored."""
    raw = native(tmp_path, rich_trace)
    _, hlen = header_of(raw)
    text = raw[PRE : PRE + hlen].rstrip(b" ")
    assert edit[0] in text
    p = tmp_path / "keys.moetrace"
    p.write_bytes(with_text(raw, text.replace(edit[0], edit[1], 1)[:hlen]))
    with pytest.raises(BadInput) as exc:
        load_trace(p)
    assert needle in str(exc.value)


def test_moetrace_nonzero_padding_rejected(tmp_path, rich_trace):
    raw = bytearray(native(tmp_path, rich_trace))
    header, _ = header_of(bytes(raw))
    pad = header["body"]["offset"] + 240 * 6  # first padding byte after the ids
    assert pad < header["weights"]["offset"]
    raw[pad] = 1
    # keep the checksum right so the padding check itself is what fails
    crc = zlib.crc32(bytes(raw[header["body"]["offset"] :]))
    fixed = with_header(bytes(raw), lambda h: h["body"].update(crc32=f"{crc:08x}"))
    p = tmp_path / "pad.moetrace"
    p.write_bytes(fixed)
    with pytest.raises(BadInput, match="padding between ids and weights is not zero"):
        load_trace(p)


def test_moetrace_is_memory_mapped(tmp_path, rich_trace):
    t = load_trace(save_trace(rich_trace, tmp_path / "m.moetrace").path)
    assert isinstance(t.ids, np.memmap) and isinstance(t.weights, np.memmap)


# ------------------------------------------------------------------ text
def write_text(tmp_path: Path, text: str, name: str = "t.txt") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_text_peer_example_any_order_and_comments(tmp_path):
    p = write_text(
        tmp_path,
        "# the seed's example, shuffled, with comments\n"
        "1 1 9 8 7 6   # inline comment\n"
        "0 0 12 44 7 91\n"
        "\n"
        "   1 0 1 2 3 4\n"
        "0\t1\t3 55 8 12\r\n",
    )
    t = load_trace(p, n_expert=100)
    assert t.ids.tolist() == [[[12, 44, 7, 91], [3, 55, 8, 12]], [[1, 2, 3, 4], [9, 8, 7, 6]]]
    assert t.n_expert == 100 and t.block_map is None


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("0 0 1 2\n0 1 3 4\n1 0 5 6\n", "token 1 layer 1 is missing"),
        ("0 0 1 2\n0 1 3 4\n0 0 5 6\n", "token 0 layer 0 appears twice (lines 1 and 3)"),
        ("0 0 1 2\n0 1 3 4 5\n", "line 2: 3 experts, but line 1 has 2"),
        ("0 0 1 2\n0 1\n", "line 2: expected '<token> <layer> <expert> ...', got 2"),
        ("0 0 1 2\n0 1 3 x\n", "line 2: unexpected 'x'"),
        ("0 0 1 -2\n", "line 1: unexpected '-'"),
        ("0 0 1 2\n0 1 3 9\n", "line 2: expert id 9 is out of range for 8 experts"),
        ("0 0 1 2\n0 1 4 4\n", "line 2: an expert appears twice in [4, 4]"),
        ("# only comments\n\n", "holds no (token, layer) lines"),
    ],
)
def test_text_bad_input(tmp_path, text, needle):
    with pytest.raises(BadInput) as exc:
        load_trace(write_text(tmp_path, text), n_expert=8)
    assert needle in str(exc.value)


def test_text_without_expert_count_is_an_error(tmp_path):
    p = write_text(tmp_path, "0 0 1 2\n")
    with pytest.raises(TraceNeeds) as exc:
        load_trace(p)
    msg = str(exc.value)
    assert "does not say how many experts" in msg and "never guesses" in msg
    assert exc.value.need == NEED_N_EXPERT and "--" not in msg  # options are the CLI's to name


def test_text_expert_count_from_the_model(tmp_path, model):
    p = write_text(
        tmp_path, "".join(f"{t} {l_} 1 {t % 7 + 2}\n" for t in range(4) for l_ in range(3))
    )
    t = load_trace(p, model=model)
    assert t.n_expert == 8 and t.tokens == 4


def test_text_declaration_written_and_checked(tmp_path, rich_trace):
    p = save_trace(rich_trace, tmp_path / "d.txt").path
    lines = p.read_text().splitlines()
    assert lines[1].startswith("# moepack: n_expert=8 prefill_tokens=17 block_map=1,3,4")
    assert load_trace(p).n_expert == 8
    with pytest.raises(BadInput, match="declares n_expert=8, but n_expert=16 was given$"):
        load_trace(p, n_expert=16)


def test_declared_expert_count_against_the_model(tmp_path, rich_trace, wide_model_path):
    """A declared count that the model contradicts names the model, not an option."""
    for name in ("d.txt", "d.csv"):
        p = save_trace(rich_trace, tmp_path / name).path
        with MoeModel(wide_model_path) as wide, pytest.raises(BadInput) as exc:
            load_trace(p, model=wide)
        assert str(exc.value).endswith(f"n_expert=8, but the model {wide_model_path} has 16")


def test_text_large_is_parsed_in_chunks(tmp_path, monkeypatch):
    import moepack.trace.formats._textnum as tn

    monkeypatch.setattr(tn, "READ_CHUNK", 37)  # forces many chunk boundaries mid-line
    rng = np.random.default_rng(3)
    ids = np.argsort(rng.random((300, 2, 1000)), axis=2)[:, :, :3]
    t = RoutingTrace(ids=ids.astype(np.uint16), n_expert=1000)
    p = save_trace(t, tmp_path / "big.txt").path
    assert np.array_equal(load_trace(p).ids, t.ids)
    bad = p.read_text().replace("\n150 1 ", "\n150 1 1000 ", 1)
    p.write_text(bad)
    with pytest.raises(BadInput, match="line 304: 4 experts, but line 3 has 3"):
        load_trace(p)


# ------------------------------------------------------------------ route_trace CSV
ROUTE = """# route_trace v1
# model=/models/Qwen3-30B-A3B-Q4_K_M.gguf arch=qwen3moe n_layer=4 n_expert=8 n_expert_used=2
# layer=1 expert_bytes=1000 dense_bytes=10
# layer=3 expert_bytes=1000 dense_bytes=10
turn,phase,step,layer,slot,expert,weight,residency,expert_bytes,dropped
0,0,0,1,0,5,0.6,0,1000,0
0,0,0,1,1,2,0.4,0,1000,0
0,0,1,1,0,5,0.7,0,0,0
0,0,1,1,1,3,0.3,0,1000,0
0,0,1,3,0,0,0.5,0,1000,0
0,0,1,3,1,1,0.5,0,1000,0
0,1,2,1,1,6,0.25,1,0,0
0,1,2,1,0,5,0.75,1,0,0
0,1,2,3,0,1,0.9,1,0,0
0,1,2,3,1,7,0.1,0,1000,0
"""


def test_routecsv_reads_a_capture(tmp_path):
    p = write_text(tmp_path, ROUTE, "cap.csv")
    t = load_trace(p)
    # step 0 of prefill misses layer 3 (llama.cpp routes only the last prompt token there)
    assert t.ids.tolist() == [[[5, 3], [0, 1]], [[5, 6], [1, 7]]]
    assert t.block_map == [1, 3] and t.n_expert == 8 and t.prefill_tokens == 1
    assert t.weights is not None
    assert np.allclose(t.weights, [[[0.7, 0.3], [0.5, 0.5]], [[0.75, 0.25], [0.9, 0.1]]])
    assert t.provenance["model"] == "/models/Qwen3-30B-A3B-Q4_K_M.gguf"
    assert "dropped 1 prefill tokens" in t.provenance["notes"][0]


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda s: s.replace("n_expert=8 ", ""), "preamble has no n_expert"),
        (lambda s: s.replace("0,1,2,3,1,7", "0,1,2,3,1,9"), "expert id 9 is out of range"),
        (lambda s: s.replace("0,1,2,3,1,7,0.1,0,1000,0\n", ""), "lists 1 of 2 slots"),
        (lambda s: s.replace("0,1,2,1,1,6", "0,1,2,1,0,6"), "route the same slot twice"),
        (
            lambda s: s.replace("0,1,2,3,0,1,0.9,1,0,0\n0,1,2,3,1,7,0.1,0,1000,0\n", ""),
            "decode token at turn 0 step 2 has no routing for layer 3",
        ),
        (
            lambda s: s.replace(
                "turn,phase,step,layer,slot,expert", "turn,phase,step,layer,slot,ex"
            ),
            "lacks column(s) expert",
        ),
        (lambda s: s.replace("# route_trace v1", "# route_trace v9"), "not a route trace"),
    ],
)
def test_routecsv_bad_input(tmp_path, edit, needle):
    p = write_text(tmp_path, edit(ROUTE), "bad.csv")
    with pytest.raises(BadInput) as exc:
        load_trace(p, format="routecsv")
    assert needle in str(exc.value)


def test_routecsv_nan_weights_are_dropped_with_a_note(tmp_path):
    p = write_text(tmp_path, ROUTE.replace(",0.9,", ",nan,"), "nan.csv")
    t = load_trace(p)
    assert t.weights is None
    assert any("weights dropped" in n for n in t.provenance["notes"])
