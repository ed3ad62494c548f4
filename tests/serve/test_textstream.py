"""Streamed text joins to the plain text, byte for byte, on the pieces of a real vocabulary (the
byte tokens of a synthetic model's GGUF, ``<0xNN>``, whose pieces llama.cpp detokenises to
that byte): characters split over tokens, bytes that are no text, stop sequences split over
tokens, the space after BOS."""

from __future__ import annotations

from pathlib import Path

import pytest

from moefixtures import tiny_spec
from moepack.checkpoint.gguf_file import GgufFile
from moepack.checkpoint.synth import synth_model
from moepack.serve.textstream import StreamText

# what deepseek2 and glm4moe streamed short of (issue 25): "ӧ" is two bytes, D3 A7
ISSUE = "…fliuglӧIasetWi"


@pytest.fixture(scope="module")
def pieces(tmp_path_factory) -> dict[int, bytes]:
    """byte -> that byte token's piece, read from the model's vocabulary."""
    path = synth_model(tmp_path_factory.mktemp("vocab") / "m.gguf", tiny_spec()).paths[0]
    g = GgufFile(Path(path))
    names = list(g.get("tokenizer.ggml.tokens"))
    g.close()
    out = {}
    for name in names:
        if name.startswith("<0x") and name.endswith(">"):
            value = int(name[3:-1], 16)
            out[value] = bytes([value])
    assert len(out) == 256
    return out


def _stream(tokens: list[bytes], stops: list[bytes], plain: str, strip: bool = False) -> list[str]:
    text = StreamText(stops, strip_space=strip)
    chunks = [text.feed(t) for t in tokens]
    chunks.append(text.finish(plain))
    return [c for c in chunks if c]


def _tokens(data: bytes, pieces: dict[int, bytes]) -> list[bytes]:
    return [pieces[b] for b in data]


def test_a_character_split_over_two_tokens_streams_whole(pieces):
    tokens = _tokens(ISSUE.encode(), pieces)
    plain = b"".join(tokens).decode("utf-8", errors="ignore")
    chunks = _stream(tokens, [], plain)
    assert "".join(chunks) == plain == ISSUE
    assert "ӧ" in chunks  # released once its second byte came, as one chunk
    assert all("\ufffd" not in c for c in chunks)


@pytest.mark.parametrize(
    "data",
    [
        b"ab\xa7cd",  # a continuation byte with no lead
        b"ab\xd3cd",  # a lead byte cut short by ASCII
        b"\xe2\x80",  # a three-byte character that never ends
        b"x\xf0\x9f\x98\x80y\xf0\x9f",  # an emoji whole, then half of one
        "日本語".encode() + b"\xff" + "ß".encode(),
    ],
)
def test_bytes_that_are_no_text_are_dropped_as_the_plain_text_drops_them(pieces, data):
    tokens = _tokens(data, pieces)
    plain = data.decode("utf-8", errors="ignore")
    assert "".join(_stream(tokens, [], plain)) == plain


def test_a_stop_sequence_split_over_tokens_is_never_streamed(pieces):
    data = ISSUE.encode()
    stop = b"Ias"
    tokens = _tokens(data, pieces)
    plain = data[: data.index(stop)].decode("utf-8", errors="ignore")  # the plain text's cut
    text = StreamText([stop])
    streamed = ""
    for t in tokens:
        streamed += text.feed(t)
        assert "I" not in streamed  # the start of the stop is held while it could be one
    streamed += text.finish(plain)
    assert streamed == plain == "…fliuglӧ"


def test_a_held_prefix_that_is_no_stop_is_streamed_after_all(pieces):
    data = b"abIaxyz"
    tokens = _tokens(data, pieces)
    text = StreamText([b"Ias"])
    got = [text.feed(t) for t in tokens]
    assert got == ["a", "b", "", "", "Iax", "y", "z"]
    assert text.finish("abIaxyz") == ""


def test_the_space_after_bos_is_dropped_as_llama_cpp_python_drops_it(pieces):
    tokens = _tokens(b" hi", pieces)
    assert _stream(tokens, [], "hi", strip=True) == ["h", "i"]
