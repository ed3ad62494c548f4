"""Block and layer lists such as ``0-3,5``: one parser and one formatter for every option and
file that names blocks or layers (``--block-map``, NPU ``--layers``, text-trace declarations,
messages).

The parser sizes a list from its text before it builds anything, and refuses a number past
the caller's limit or a list longer than it, so ``0-99999999999999`` is a one-line error, not
a ``MemoryError`` or a gigabyte of integers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from .errors import BadInput

# More blocks or layers than any model has (the largest have a few hundred); callers that
# know the real count pass it as ``limit``.
MAX_INDEX = 4096

_PART = re.compile(r"(\d{1,18})(?:-(\d{1,18}))?")


def parse_index_list(
    text: str,
    item: str = "block",
    what: str | None = None,
    limit: int = MAX_INDEX,
    unique: bool = False,
) -> list[int]:
    """``'0-3,5'`` -> ``[0, 1, 2, 3, 5]``, in the order written (``unique``: sorted, each
    once). Every number must be below ``limit`` and the list at most ``limit`` long; ``item``
    and ``what`` name the numbers and the list in messages (``what`` defaults to
    ``'<item> list'``)."""
    what = what or f"{item} list"
    spans: list[tuple[int, int]] = []
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            continue
        m = _PART.fullmatch(part.replace(" ", ""))
        if m is None:
            if re.fullmatch(r"\d+(-\d+)?", part.replace(" ", "")):  # only too many digits
                raise BadInput(f"{what} {text!r}: {part!r} is {_past(item, limit)}")
            raise BadInput(
                f"{what} {text!r}: {part!r} is not N or N-M (a {item} number or a range like 4-7)"
            )
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise BadInput(f"{what} {text!r}: {part!r} is reversed")
        if hi >= limit:
            raise BadInput(f"{what} {text!r}: {item} {hi} is {_past(item, limit)}")
        spans.append((lo, hi))
    if not spans:
        raise BadInput(f"{what} {text!r} names no {item}s")
    count = sum(hi - lo + 1 for lo, hi in spans)
    if count > limit:
        raise BadInput(f"{what} {text!r} names {count:,} {item}s; at most {limit:,} are allowed")
    out = [n for lo, hi in spans for n in range(lo, hi + 1)]
    return sorted(set(out)) if unique else out


def _past(item: str, limit: int) -> str:
    return f"out of range (at most {limit:,} {item}s: 0-{limit - 1})"


def format_index_list(numbers: Iterable[int], sep: str = ",") -> str:
    """``[0, 1, 2, 3, 5]`` -> ``'0-3,5'`` (sorted, runs joined; ``'none'`` when empty); the
    parser reads it back as the same set."""
    ordered = sorted(set(int(n) for n in numbers))
    runs: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return sep.join(runs) if runs else "none"
