"""Execute compiled segments: one ``np.take`` per segment (or a chunked fancy-index fallback).

``gather`` fills a buffer from a source byte array (the file's map); ``scatter`` is the
inverse, writing buffer bytes back to their source positions (unpack).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .plan import BufferPlan

STEP_BYTES = 32 * 1024 * 1024  # progress granularity and fallback chunk size


def _rows(u8: np.ndarray, g: int, r: int) -> np.ndarray:
    n = (u8.size - r) // g
    return u8[r : r + n * g].reshape(n, g)


def _byte_rows(u8: np.ndarray, g: int) -> np.ndarray:
    """Rows of ``g`` bytes starting at *every* byte offset (a read-only overlapping view)."""
    return as_strided(u8, shape=(u8.size - g + 1, g), strides=(1, 1), writeable=u8.flags.writeable)


def gather(
    buf: np.ndarray, plan: BufferPlan, src: np.ndarray, advance: Callable[[int], None] | None = None
) -> None:
    """Fill ``buf`` (zeroed, ``plan.size`` bytes) from ``src`` (the source's bytes)."""
    src = src[plan.base :]
    views: dict[tuple[int, int], np.ndarray] = {}
    for seg in plan.segments:
        dst = buf[seg.dst : seg.dst + seg.nbytes].reshape(seg.n, seg.g)
        per = max(1, STEP_BYTES // seg.g)
        if seg.mode == "take":
            key = (seg.g, seg.r)
            if key not in views:
                views[key] = _rows(src, seg.g, seg.r)
            view = views[key]
            for i in range(0, seg.n, per):
                np.take(view, seg.src[i : i + per], axis=0, out=dst[i : i + per], mode="clip")
                if advance:
                    advance(min(per, seg.n - i) * seg.g)
        else:
            view = _byte_rows(src, seg.g)
            for i in range(0, seg.n, per):
                dst[i : i + per] = view[seg.src[i : i + per]]
                if advance:
                    advance(min(per, seg.n - i) * seg.g)


Release = Callable[[int, int], None]


def _steps(
    buf: np.ndarray, plan: BufferPlan, side: np.ndarray, release: Release | None
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Every step of every segment as (buffer rows, the source-side row view, their source
    rows); ``release`` gets each step's buffer range once the caller is done with it."""
    side = side[plan.base :]
    for seg in plan.segments:
        rows = buf[seg.dst : seg.dst + seg.nbytes].reshape(seg.n, seg.g)
        view = _rows(side, seg.g, seg.r) if seg.mode == "take" else _byte_rows(side, seg.g)
        per = max(1, STEP_BYTES // seg.g)
        for i in range(0, seg.n, per):
            yield rows[i : i + per], view, seg.src[i : i + per]
            if release:
                release(seg.dst + i * seg.g, seg.dst + min(seg.n, i + per) * seg.g)


def scatter(
    buf: np.ndarray, plan: BufferPlan, out: np.ndarray, release: Release | None = None
) -> None:
    """Write every placed byte of ``buf`` back to its source position in ``out``.

    ``release(lo, hi)`` is called after each step with the buffer range just consumed
    (segments run in buffer order), so a mapped ``buf`` can drop its pages behind us."""
    for rows, view, src_rows in _steps(buf, plan, out, release):
        view[src_rows] = rows


def count_mismatches(
    buf: np.ndarray, plan: BufferPlan, src: np.ndarray, release: Release | None = None
) -> int:
    """Placed bytes of ``buf`` that differ from what ``src`` holds at their source positions."""
    return sum(
        int(np.count_nonzero(view[src_rows] != rows))
        for rows, view, src_rows in _steps(buf, plan, src, release)
    )


def gather_range(out: np.ndarray, plan: BufferPlan, src: np.ndarray, lo: int) -> None:
    """Fill ``out`` with the buffer's bytes ``[lo, lo + out.size)`` (zero where nothing is
    placed): the buffer built a window at a time, so a 533 MB buffer need not be in memory.
    Granules cut by the window's edges are copied in part."""
    hi = lo + out.size
    src = src[plan.base :]
    for s, e in plan.gaps_between(lo, hi):
        out[s - lo : e - lo] = 0
    starts, ends = plan.segment_bounds
    i0 = int(np.searchsorted(ends, lo, side="right"))
    i1 = int(np.searchsorted(starts, hi, side="left"))
    for seg in plan.segments[i0:i1]:
        g = seg.g
        view = _rows(src, g, seg.r) if seg.mode == "take" else _byte_rows(src, g)
        a, b = max(lo, seg.dst), min(hi, seg.dst + seg.nbytes)
        ka, kb = -(-(a - seg.dst) // g), (b - seg.dst) // g  # whole granules inside [a, b)
        if ka < kb:
            rows = out[seg.dst + ka * g - lo : seg.dst + kb * g - lo].reshape(kb - ka, g)
            per = max(1, STEP_BYTES // g)
            for i in range(ka, kb, per):
                j = min(kb, i + per)
                part = rows[i - ka : j - ka]
                if seg.mode == "take":
                    np.take(view, seg.src[i:j], axis=0, out=part, mode="clip")
                else:
                    part[:] = view[seg.src[i:j]]
        for k in {(a - seg.dst) // g, (b - 1 - seg.dst) // g}:  # granules cut by the window
            gs = seg.dst + k * g
            if ka <= k < kb:
                continue
            s0, s1 = max(a, gs), min(b, gs + g)
            out[s0 - lo : s1 - lo] = view[seg.src[k]][s0 - gs : s1 - gs]
