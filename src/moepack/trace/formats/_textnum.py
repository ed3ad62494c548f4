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

READ_CHUNK = 1 << 20  # small chunks: numpy temporaries stay in reused heap memory
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
    values: np.ndarray  # all numbers, in order (int32, or int64 for long numbers)


def _parse_chunk(data: bytes, first_line: int, path: Path) -> LineBlock:
    b = np.frombuffer(data, dtype=np.uint8)
    ok = _ALLOWED[b]
    if not ok.all():
        pos = int(np.argmin(ok))
        line = first_line + data.count(b"\n", 0, pos)
        start = data.rfind(b"\n", 0, pos) + 1
        end = data.find(b"\n", pos)
        text = data[start : end if end >= 0 else len(data)].decode("utf-8", "replace").strip()
        bad = data[pos : pos + 1].decode("utf-8", "replace")
        raise BadInput(
            f"line {line}: unexpected {bad!r} in {text!r} (expected non-negative integers)", path
        )
    digit = b - np.uint8(48)  # wraps for everything below '0'
    isdig = digit < 10
    edge = np.flatnonzero(isdig[1:] != isdig[:-1]) + 1  # where runs of digits start or end
    if isdig.size and isdig[0]:
        edge = np.concatenate(([0], edge))
    if isdig.size and isdig[-1]:
        edge = np.concatenate((edge, [isdig.size]))
    starts, stops = edge[0::2], edge[1::2]
    if starts.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return LineBlock(empty, empty, empty)
    lengths = stops - starts
    line_of = np.cumsum(b == 10, dtype=np.int32)[starts].astype(np.int64) + first_line
    longest = int(lengths.max())
    if longest > MAX_DIGITS:
        i = int(np.argmax(lengths > MAX_DIGITS))
        raise BadInput(f"line {int(line_of[i])}: number with more than {MAX_DIGITS} digits", path)
    dt = np.dtype(np.int32 if longest <= 9 else np.int64)
    values: np.ndarray = np.zeros(starts.size, dtype=dt)
    last = stops - 1
    for p in range(longest):  # units, tens, hundreds, ... of every number at once
        dig: np.ndarray = digit[np.maximum(last - p, 0)].astype(dt)
        if p:
            dig *= lengths > p
        values += dig * dt.type(_POW10[p])
    change = np.flatnonzero(line_of[1:] != line_of[:-1]) + 1
    bounds = np.concatenate(([0], change, [line_of.size]))
    return LineBlock(line_of[bounds[:-1]], np.diff(bounds), values)


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
    n, c = rows.shape
    top = int(rows.max())
    dt = np.int32 if top < 2**31 else np.int64
    v = np.ascontiguousarray(rows, dtype=dt)
    pow10 = _POW10.astype(dt) if dt is np.int32 else _POW10
    ndig = np.ones((n, c), dtype=np.int64)
    most = [len(str(int(m))) for m in v.max(axis=0)]  # widest number of each column
    for j in range(c):
        for d in range(1, most[j]):
            ndig[:, j] += v[:, j] >= pow10[d]
    ends = np.cumsum(ndig.ravel() + 1).reshape(n, c)  # each number then a space or newline
    total = int(ends[-1, -1])
    out = np.full(total + 1, 32, dtype=np.uint8)  # the extra byte is a scratch target
    out[ends[:, -1] - 1] = 10
    scratch = np.int64(total)
    for j in range(c):
        pos = ends[:, j] - 2  # units digit
        q: np.ndarray = v[:, j].copy()
        for d in range(most[j]):
            at = pos - d if d == 0 else np.where(ndig[:, j] > d, pos - d, scratch)
            out[at] = 48 + q % 10
            q //= 10
    return out[:total].tobytes()
