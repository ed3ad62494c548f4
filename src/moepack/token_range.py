"""Token ranges of a trace (``START:END``), as ``analyse`` and ``replay`` take them: base
plumbing, so neither reaches into the other for it."""

from __future__ import annotations

from .errors import BadInput


def parse_token_range(text: str | None, n_tokens: int) -> tuple[int, int]:
    """``START:END`` (either side may be empty; negatives count from the end) -> a range."""
    if not text:
        return 0, n_tokens
    try:
        lo_s, hi_s = text.split(":")
        lo = int(lo_s) if lo_s else 0
        hi = int(hi_s) if hi_s else n_tokens
    except ValueError:
        raise BadInput(f"token range must be START:END, got {text!r}") from None
    lo, hi = (lo + n_tokens if lo < 0 else lo), (hi + n_tokens if hi < 0 else hi)
    if not 0 <= lo < hi <= n_tokens:
        raise BadInput(f"token range {text!r} is empty or outside the trace's {n_tokens} tokens")
    return lo, hi
