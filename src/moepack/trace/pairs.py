"""How many tokens chose expert ``i`` in one set and ``j`` in another, kept sparse.

A dense ``[n_expert, n_expert]`` table is what a bincount makes fastest, but it grows with the
square of the expert count a header declares, not with the trace: a 4 KB trace declaring
8,192 experts asked for gigabytes, 65,536 experts for 32 GiB. ``PairCounts`` holds only the
pairs that occur (at most ``tokens × k²`` of them), so memory follows the trace's own bytes;
up to ``DENSE_EXPERTS`` experts it is built from the dense bincount, which is small there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .core import token_chunks

DENSE_EXPERTS = 1024
"""Up to this many experts the pairs come from a dense bincount (8 MiB of int64 at most)."""


def pair_counts(a: np.ndarray, b: np.ndarray, n_expert: int) -> np.ndarray:
    """``[n, n]``: for rows ``a[t]`` and ``b[t]`` (``[tokens, k]`` each), how many tokens
    chose expert ``i`` in ``a`` and ``j`` in ``b``, in bounded chunks of tokens. Dense: for
    callers that know ``n_expert`` is small (see ``PairCounts`` otherwise)."""
    k = a.shape[1]
    out = np.zeros(n_expert * n_expert, dtype=np.int64)
    for sl in token_chunks(a.shape[0], k * k):
        pairs = a[sl].astype(np.int64)[:, :, None] * n_expert + b[sl][:, None, :]
        out += np.bincount(pairs.ravel(), minlength=n_expert * n_expert)
    return out.reshape(n_expert, n_expert)


@dataclass(frozen=True)
class PairCounts:
    """The non-zero cells of a pair-count table: ``code = i * n + j`` ascending, each with
    its count (> 0)."""

    n: int
    code: np.ndarray  # int64, sorted, unique
    count: np.ndarray  # int64

    @property
    def i(self) -> np.ndarray:
        return self.code // self.n

    @property
    def j(self) -> np.ndarray:
        return self.code % self.n

    @classmethod
    def from_dense(cls, table: np.ndarray) -> PairCounts:
        flat = np.asarray(table).ravel()
        code = np.flatnonzero(flat).astype(np.int64)
        return cls(int(table.shape[0]), code, flat[code].astype(np.int64))

    @classmethod
    def of(
        cls, a: np.ndarray, b: np.ndarray, n_expert: int, dense_limit: int = DENSE_EXPERTS
    ) -> PairCounts:
        """The pairs of rows ``a[t]`` and ``b[t]`` (as ``pair_counts``)."""
        if n_expert <= dense_limit:
            return cls.from_dense(pair_counts(a, b, n_expert))
        k = a.shape[1]
        parts = []
        for sl in token_chunks(a.shape[0], k * k):
            codes = a[sl].astype(np.int64)[:, :, None] * n_expert + b[sl][:, None, :]
            parts.append(np.unique(codes.ravel(), return_counts=True))
        return _merge(n_expert, parts)

    def __add__(self, other: PairCounts) -> PairCounts:
        return _merge(self.n, [(self.code, self.count), (other.code, other.count)])

    def off_diagonal(self) -> PairCounts:
        keep = self.i != self.j
        return PairCounts(self.n, self.code[keep], self.count[keep])

    def upper(self) -> PairCounts:
        """Only the cells with ``i < j`` (one of each pair of a symmetric table)."""
        keep = self.i < self.j
        return PairCounts(self.n, self.code[keep], self.count[keep])

    def total(self) -> int:
        return int(self.count.sum())

    def row_max(self) -> np.ndarray:
        """The largest count of each row that has any (rows in ascending order)."""
        if self.code.size == 0:
            return np.zeros(0, dtype=np.int64)
        rows = self.i
        starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
        return np.maximum.reduceat(self.count, starts)

    def dense(self) -> np.ndarray:
        """The whole table (for small ``n`` only)."""
        out = np.zeros(self.n * self.n, dtype=np.int64)
        out[self.code] = self.count
        return out.reshape(self.n, self.n)


def _merge(n: int, parts: list[tuple[np.ndarray, np.ndarray]]) -> PairCounts:
    if not parts:
        return PairCounts(n, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    codes = np.concatenate([c for c, _ in parts]).astype(np.int64, copy=False)
    counts = np.concatenate([c for _, c in parts]).astype(np.int64, copy=False)
    if codes.size == 0:
        return PairCounts(n, codes, counts)
    order = np.argsort(codes, kind="stable")
    codes, counts = codes[order], counts[order]
    starts = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1]])
    return PairCounts(n, codes[starts], np.add.reduceat(counts, starts))
