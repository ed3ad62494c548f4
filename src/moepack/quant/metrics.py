"""Difference metrics between a reference and a candidate, accumulated chunk by chunk.

Chunk sums are added in float64, so a tensor of billions of values is measured in bounded memory
and the correlation of two nearly equal tensors keeps its digits. Pieces whose float32 sums
overflow or come near float32's range (values of 3e38: their squares overflow) are measured in
float64, silently: no numpy warning reaches the user. Non-finite values are counted; positions
where either side is non-finite are left out of the other metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

PIECE = 1 << 16
"""Values measured at a time (float32 temporaries of 256 KiB: they stay in cache)."""
_WIDE = 1e30
"""A float32 piece sum beyond this is redone in float64: near float32's 3.4e38 a sum of
squares has already lost digits, or overflowed on the way (numpy would warn)."""


@dataclass
class DiffStats:
    """Running sums over (reference ``a``, candidate ``b``) value pairs."""

    n: int = 0
    nonfinite_a: int = 0
    nonfinite_b: int = 0
    sum_a: float = 0.0
    sum_b: float = 0.0
    sum_aa: float = 0.0
    sum_bb: float = 0.0
    sum_ab: float = 0.0
    sum_dd: float = 0.0
    max_abs: float = 0.0

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        """Accumulate one chunk of equally long float32 arrays.

        Pieces of ``PIECE`` values stay in cache and are summed in float32 by numpy's pairwise
        summation (relative error ~1e-7), then added in float64; no BLAS, whose threads would
        fight over a busy machine. A piece with non-finite or huge values is redone in float64
        with those positions left out."""
        for lo in range(0, a.size, PIECE):
            self._add_piece(a[lo : lo + PIECE], b[lo : lo + PIECE])

    def _add_piece(self, a: np.ndarray, b: np.ndarray) -> None:
        with np.errstate(over="ignore", invalid="ignore"):  # overflow: redone in float64
            d = b - a
            sums = [float(np.sum(x)) for x in (a, b, a * a, b * b, a * b, d * d)]
        if not all(math.isfinite(v) for v in sums) or max(map(abs, sums)) > _WIDE:
            self._add_wide(a, b)
            return
        self.n += int(a.size)
        self._sums(sums)
        if d.size:
            self.max_abs = max(self.max_abs, float(np.max(np.abs(d))))

    def _add_wide(self, a: np.ndarray, b: np.ndarray) -> None:
        with np.errstate(invalid="ignore"):  # a signalling NaN raises the flag as it widens
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
        fa, fb = np.isfinite(a64), np.isfinite(b64)
        self.nonfinite_a += int(a64.size - np.count_nonzero(fa))
        self.nonfinite_b += int(b64.size - np.count_nonzero(fb))
        keep = fa & fb
        a64, b64 = a64[keep], b64[keep]
        d = b64 - a64
        self.n += int(a64.size)
        self._sums([float(np.sum(x)) for x in (a64, b64, a64 * a64, b64 * b64, a64 * b64, d * d)])
        if d.size:
            self.max_abs = max(self.max_abs, float(np.max(np.abs(d))))

    def _sums(self, sums: list[float]) -> None:
        sa, sb, saa, sbb, sab, sdd = sums
        self.sum_a += sa
        self.sum_b += sb
        self.sum_aa += saa
        self.sum_bb += sbb
        self.sum_ab += sab
        self.sum_dd += sdd

    def merge(self, other: DiffStats) -> None:
        for name in ("n", "nonfinite_a", "nonfinite_b", "sum_a", "sum_b", "sum_aa", "sum_bb"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.sum_ab += other.sum_ab
        self.sum_dd += other.sum_dd
        self.max_abs = max(self.max_abs, other.max_abs)

    def metrics(self) -> Metrics:
        n = self.n
        rmse = math.sqrt(self.sum_dd / n) if n else 0.0
        rel = math.sqrt(self.sum_dd / self.sum_aa) if self.sum_aa > 0 else None
        if self.sum_dd == 0:
            rel = 0.0
        var_a = n * self.sum_aa - self.sum_a**2
        var_b = n * self.sum_bb - self.sum_b**2
        corr = None
        if var_a > 0 and var_b > 0:
            saa, sbb = var_a / n, var_b / n
            if 0.25 <= saa / sbb <= 4.0:
                # 1 - r from the centred squared difference: exact digits when r is close to
                # 1 (spreads this close, nothing cancels)
                sdd = max(0.0, self.sum_dd - (self.sum_b - self.sum_a) ** 2 / n)
                gap = (math.sqrt(saa) - math.sqrt(sbb)) ** 2
                corr = 1.0 - (sdd - gap) / (2.0 * math.sqrt(saa * sbb))
            else:  # one side spreads far more: the difference is all its spread, which
                # would cancel in the form above and leave r = 1; the covariance does not
                cov = (n * self.sum_ab - self.sum_a * self.sum_b) / n  # centred, as saa
                corr = cov / math.sqrt(saa * sbb)
            corr = max(-1.0, min(1.0, corr))
        elif self.sum_dd == 0 and n:
            corr = 1.0  # identical constant values
        cos = None
        if self.sum_aa > 0 and self.sum_bb > 0:
            cos = max(-1.0, min(1.0, self.sum_ab / math.sqrt(self.sum_aa * self.sum_bb)))
        snr = None
        if self.sum_dd > 0 and self.sum_aa > 0:
            snr = 10 * math.log10(self.sum_aa / self.sum_dd)
        return Metrics(
            values=n,
            rmse=rmse,
            max_abs=self.max_abs,
            rel_error=rel,
            correlation=corr,
            cosine=cos,
            snr_db=snr,
            identical=self.sum_dd == 0 and self.nonfinite_a == self.nonfinite_b,
            nonfinite_ref=self.nonfinite_a,
            nonfinite_cand=self.nonfinite_b,
        )


@dataclass(frozen=True)
class Metrics:
    """How far a candidate is from its reference. ``None`` where a metric is undefined (a
    zero reference has no relative error; identical values have no finite SNR)."""

    values: int
    rmse: float
    max_abs: float
    rel_error: float | None
    correlation: float | None
    cosine: float | None
    snr_db: float | None
    identical: bool
    nonfinite_ref: int
    nonfinite_cand: int

    def badness(self) -> tuple[float, float]:
        """Sort key, worst first: lowest correlation, then largest relative error."""
        corr = self.correlation if self.correlation is not None else -2.0
        return (corr, -(self.rel_error or 0.0))
