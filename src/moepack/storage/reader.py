"""Reading byte ranges through any engine and mode, with the bytes a plain read returns.

O_DIRECT can only read aligned spans. A request that is not aligned is refused with a clear
error, or — when the caller allows it — widened to the aligned span around it and trimmed
back, with the extra bytes accounted (``requested_bytes`` vs ``device_bytes``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import BadInput
from .engine import get_engine
from .modes import Mode, OpenFile, open_file


@dataclass
class ReadOutcome:
    """The bytes of each request, and what it cost the device."""

    data: list[bytes]
    requested_bytes: int  # sum of the requested lengths
    returned_bytes: int  # sum of the lengths returned (shorter only past end of file)
    device_bytes: int  # bytes the engine read, widened spans included
    widened: int  # requests that were widened to meet O_DIRECT alignment


class _RangeWork:
    def __init__(self, spans: list[tuple[int, int]]) -> None:
        self.spans = spans
        self.max_length = max((n for _, n in spans), default=1) or 1
        self.results: list[bytes | None] = [None] * len(spans)
        self.device_bytes = 0
        self._i = 0

    def next(self) -> tuple[int, int, int] | None:
        while self._i < len(self.spans):
            i = self._i
            self._i += 1
            off, n = self.spans[i]
            if n > 0:
                return i, off, n
            self.results[i] = b""
        return None

    def complete(self, token: int, data: memoryview, nbytes: int, latency_ns: int) -> None:
        self.results[token] = bytes(data[:nbytes])
        self.device_bytes += nbytes


def _aligned_spans(
    f: OpenFile, ranges: Sequence[tuple[int, int]], widen: bool
) -> tuple[list[tuple[int, int]], int]:
    align = f.offset_align
    spans: list[tuple[int, int]] = []
    widened = 0
    for i, (off, n) in enumerate(ranges):
        if off < 0 or n < 0:
            raise BadInput(f"request {i}: offset and length must be >= 0 (got {off}, {n})", f.path)
        if n == 0 or off >= f.size:
            spans.append((off, 0))
            continue
        if off % align == 0 and n % align == 0:
            spans.append((off, n))
            continue
        if not widen:
            raise BadInput(
                f"request {i} (offset {off}, length {n}) is not aligned to {align} bytes, "
                f"which O_DIRECT needs here; widen it to the aligned span or use buffered mode",
                f.path,
            )
        start = off // align * align
        end = -(-(off + n) // align) * align
        spans.append((start, end - start))
        widened += 1
    return spans, widened


def read_ranges(
    source: str | os.PathLike[str] | OpenFile,
    ranges: Sequence[tuple[int, int]],
    engine: str = "pread",
    mode: Mode = Mode.BUFFERED,
    queue_depth: int = 1,
    widen: bool = False,
) -> ReadOutcome:
    """Read each ``(offset, length)`` of ``source`` with ``engine`` in ``mode``.

    Each result equals what ``os.pread`` on a buffered descriptor returns for that range.
    """
    eng = get_engine(engine)
    reason = eng.unavailable_reason()
    if reason:
        raise BadInput(f"engine {engine!r} cannot run here: {reason}")
    owned = not isinstance(source, OpenFile)
    f = open_file(source, mode) if not isinstance(source, OpenFile) else source
    try:
        eng.check(f.mode, queue_depth)
        spans, widened = _aligned_spans(f, ranges, widen)
        work = _RangeWork(spans)
        eng.run(f, work, queue_depth)
        data: list[bytes] = []
        for (off, n), (s_off, _), got in zip(ranges, spans, work.results, strict=True):
            assert got is not None
            skip = off - s_off
            data.append(got[skip : skip + n] if n else b"")
        return ReadOutcome(
            data=data,
            requested_bytes=sum(n for _, n in ranges),
            returned_bytes=sum(len(d) for d in data),
            device_bytes=work.device_bytes,
            widened=widened,
        )
    finally:
        if owned:
            f.close()
