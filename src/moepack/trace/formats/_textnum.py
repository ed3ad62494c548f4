"""Vectorised reading and writing of whitespace-separated non-negative integers, line by line.

Used by the text trace format: millions of short lines are parsed and formatted with numpy in
bounded chunks instead of a Python loop per line.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import BadInput

READ_CHUNK = 16 << 20
MAX_DIGITS = 18
_POW10 = 10 ** np.arange(MAX_DIGITS + 1, dtype=np.int64)
_COMMENT = re.compile(rb"#[^\n]*")
_ALLOWED = np.zeros(256, dtype=bool)
_ALLOWED[[ord(c) for c in "0123456789 \t\r\n\f\v"]] = True


@dataclass
class LineBlock:
    """The numeric lines of one chunk: ``values[i]`` holds the numbers of line ``lines[i]``."""

    lines: np.ndarray  # 1-based line numbers, int64
    counts: np.ndarray  # how many numbers each of those lines holds
    values: np.ndarray  # all numbers, in order, int64


def _parse_chunk(data: bytes, first_line: int, path: Path) -> LineBlock:
    b = np.frombuffer(data, dtype=np.uint8)
    ok = _ALLOWED[b]
    if not ok.all():
        pos = int(np.argmin(ok))
        line = first_line + int(np.count_nonzero(b[:pos] == 10))
        start = data.rfind(b"\n", 0, pos) + 1
        end = data.find(b"\n", pos)
        text = data[start : end if end >= 0 else len(data)].decode("utf-8", "replace").strip()
        bad = data[pos : pos + 1].decode("utf-8", "replace")
        raise BadInput(
            f"line {line}: unexpected {bad!r} in {text!r} (expected non-negative integers)", path
        )
    isdig = (b >= 48) & (b <= 57)
    prev = np.concatenate(([False], isdig[:-1]))
    nxt = np.concatenate((isdig[1:], [False]))
    starts = np.flatnonzero(isdig & ~prev)
    ends = np.flatnonzero(isdig & ~nxt)
    newline_before = np.cumsum(b == 10)
    if starts.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return LineBlock(empty, empty, empty)
    lengths = ends - starts + 1
    if int(lengths.max()) > MAX_DIGITS:
        i = int(np.argmax(lengths > MAX_DIGITS))
        line = first_line + int(newline_before[starts[i]])
        raise BadInput(f"line {line}: number with more than {MAX_DIGITS} digits", path)
    digit_pos = np.flatnonzero(isdig)
    token_of_digit = np.repeat(np.arange(starts.size), lengths)
    power = ends[token_of_digit] - digit_pos
    contrib = (b[digit_pos].astype(np.int64) - 48) * _POW10[power]
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    values = np.add.reduceat(contrib, offsets)
    line_of = first_line + newline_before[starts].astype(np.int64)
    lines, counts = np.unique(line_of, return_counts=True)
    return LineBlock(lines, counts, values)


def iter_numeric_lines(path: Path, directives: list[tuple[int, bytes]]) -> Iterator[LineBlock]:
    """Parse ``path`` in chunks; ``#`` starts a comment. Lines that are comments of the form
    ``# moepack: ...`` are appended to ``directives`` as (line, text after the colon)."""
    first_line = 1
    carry = b""
    with open(path, "rb") as fh:
        while True:
            piece = fh.read(READ_CHUNK)
            data = carry + piece
            if not piece:
                carry = b""
            else:
                cut = data.rfind(b"\n") + 1
                if cut == 0:
                    carry = data
                    continue
                data, carry = data[:cut], data[cut:]
            if data:
                if b"#" in data:
                    for m in re.finditer(rb"(?m)^[ \t]*#[ \t]*moepack:(.*)$", data):
                        line = first_line + data.count(b"\n", 0, m.start())
                        directives.append((line, m.group(1).strip()))
                    data = _COMMENT.sub(b"", data)
                yield _parse_chunk(data, first_line, path)
                first_line += data.count(b"\n")
            if not piece:
                break


def format_rows(rows: np.ndarray) -> bytes:
    """Rows of non-negative integers as text: one line per row, numbers separated by spaces."""
    if rows.size == 0:
        return b""
    v = np.ascontiguousarray(rows, dtype=np.int64)
    n, c = v.shape
    ndig = np.maximum(np.searchsorted(_POW10, v, side="right"), 1)
    widths = ndig + 1  # each number is followed by a space or the newline
    flat_w = widths.ravel()
    ends = np.cumsum(flat_w)  # one past each number's separator
    starts = ends - flat_w
    out = np.empty(int(ends[-1]), dtype=np.uint8)
    out[ends - 1] = 32
    out[ends.reshape(n, c)[:, -1] - 1] = 10
    flat_v = v.ravel()
    flat_d = ndig.ravel()
    for d in range(int(flat_d.max())):
        m = flat_d > d
        pos = starts[m] + flat_d[m] - 1 - d
        out[pos] = 48 + (flat_v[m] // _POW10[d]) % 10
    return out.tobytes()
