"""Exact LRU stack distances of one layer's expert accesses, vectorised over the whole trace.

The access stream of a trace layer is its tokens' experts in router order, token after token
(``ids[t, layer, 0..k-1]``). The stack distance of an access is the number of *distinct* other
experts accessed since the previous access of the same expert (none: a cold access). By
Mattson's inclusion property, an LRU cache of ``C`` experts hits exactly the accesses whose
distance is below ``C``, so one histogram of distances gives the hit rate at every cache size.

Distances are counted with bitmasks of the experts (``ceil(n_expert / 64)`` words per token):
the experts of the tokens strictly between the two accesses come from a sparse table of ORs
(two lookups per access), the rest of the earlier token after the previous access and of the
current token before this one from prefix and suffix ORs within a token; a popcount of the OR
is the distance. No per-access Python: a layer of 100k tokens × top-8 is a few numpy passes.
The stream is taken ``CHUNK_TOKENS`` tokens at a time; an access whose previous one lies in an
earlier chunk (at most ``n_expert`` per chunk) counts the experts whose latest access before
the chunk is later, from one position per expert carried between chunks.
"""

from __future__ import annotations

import numpy as np

from .core import id_dtype_for

CHUNK_TOKENS = 1 << 16
"""Tokens per step: memory is bounded by a chunk's bitmasks and sparse table, not the trace."""
TABLE_WORDS = 1 << 23
"""At most this many 64-bit words (64 MiB) of a chunk's bitmasks and table (``bounded_chunk``)."""


_LATER_CELLS = 1 << 24
"""Expert cells compared at once for accesses whose previous access lies in an earlier chunk:
there are up to ``n_expert`` of them per chunk, so all at once would be ``n_expert²``."""

_POP8 = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)


def popcount(words: np.ndarray) -> np.ndarray:
    """Set bits per row of ``[..., W]`` uint64 words."""
    if hasattr(np, "bitwise_count"):  # numpy >= 2.0
        return np.bitwise_count(words).sum(axis=-1, dtype=np.int64)
    as_bytes = np.ascontiguousarray(words).view(np.uint8)
    return _POP8[as_bytes].reshape(*words.shape[:-1], -1).sum(axis=-1, dtype=np.int64)


def token_masks(ids: np.ndarray, n_expert: int) -> np.ndarray:
    """``[tokens, k] -> [tokens, W]`` uint64: each token's experts as a bitmask."""
    tokens, k = ids.shape
    words = max(1, -(-n_expert // 64))
    out = np.zeros((tokens, words), dtype=np.uint64)
    for a in range(0, tokens, CHUNK_TOKENS):
        b = min(tokens, a + CHUNK_TOKENS)
        single = _slot_masks(np.asarray(ids[a:b]), words).reshape(b - a, k, words)
        out[a:b] = np.bitwise_or.reduce(single, axis=1)
    return out


def _slot_masks(ids: np.ndarray, words: int) -> np.ndarray:
    """``[tokens * k, W]``: the bitmask of each single access, in stream order."""
    flat = ids.astype(np.int64).ravel()
    out = np.zeros((flat.size, words), dtype=np.uint64)
    out[np.arange(flat.size), flat // 64] = np.left_shift(
        np.uint64(1), (flat % 64).astype(np.uint64)
    )
    return out


def _or_table(masks: np.ndarray) -> np.ndarray:
    """``[levels * (tokens + 1), W]``: row ``j * (tokens + 1) + t`` is the OR of tokens
    ``t .. t + 2**j - 1``; row ``tokens`` of every level is all zeros (an empty range)."""
    tokens, words = masks.shape
    levels = max(1, int(tokens).bit_length())
    table = np.zeros((levels, tokens + 1, words), dtype=np.uint64)
    table[0, :tokens] = masks
    for j in range(1, levels):
        half = 1 << (j - 1)
        table[j, : tokens - half] = table[j - 1, : tokens - half] | table[j - 1, half:tokens]
    return table.reshape(levels * (tokens + 1), words)


def _chunk(
    ids: np.ndarray, n_expert: int, last: np.ndarray, base: int
) -> tuple[np.ndarray, np.ndarray]:
    """Distances of one chunk's accesses (``[tokens, k]``; global stream positions start at
    ``base``), given ``last[e]``, the position of expert ``e``'s latest access before the chunk
    (-1: none). Returns the distances and ``last`` after the chunk."""
    tokens, k = ids.shape
    words = max(1, -(-n_expert // 64))
    out = np.full(tokens * k, -1, dtype=np.int32)
    single = _slot_masks(ids, words).reshape(tokens, k, words)
    # before[t, s]: experts of token t in slots < s; after[t, s]: in slots > s
    before = np.zeros_like(single)
    after = np.zeros_like(single)
    for s in range(1, k):
        before[:, s] = before[:, s - 1] | single[:, s - 1]
        after[:, k - 1 - s] = after[:, k - s] | single[:, k - s]
    masks = before[:, k - 1] | single[:, k - 1]
    table = _or_table(masks)
    before = before.reshape(tokens * k, words)
    after = after.reshape(tokens * k, words)

    # the previous access of each access's expert: a stable sort by expert keeps time order
    # (on the narrowest integer type: numpy sorts 8- and 16-bit keys by radix)
    flat = ids.astype(id_dtype_for(n_expert)).ravel()
    order = np.argsort(flat, kind="stable")
    same = flat[order[1:]] == flat[order[:-1]]
    prev_of = np.full(flat.size, -1, dtype=np.int64)
    prev_of[order[1:][same]] = order[:-1][same]
    cur = np.flatnonzero(prev_of >= 0)  # warm within the chunk, in time order
    prev = prev_of[cur]
    acc = np.take(before, cur, axis=0) | np.take(after, prev, axis=0)
    # whole tokens strictly between the two accesses: [lo, hi), two overlapping table rows
    lo, hi = prev // k + 1, cur // k
    span = hi - lo
    some = span > 0
    j = np.zeros(span.size, dtype=np.int64)
    j[some] = np.floor(np.log2(span[some])).astype(np.int64)
    rows = tokens + 1
    first = np.where(some, j * rows + lo, tokens)  # row ``tokens``: the empty range
    second = np.where(some, j * rows + hi - (1 << j), tokens)
    acc |= np.take(table, first, axis=0)
    acc |= np.take(table, second, axis=0)
    out[cur] = popcount(acc)

    # an expert's first access in the chunk: its previous one is in an earlier chunk (at most
    # n_expert such accesses per chunk). Distinct experts since then: those whose latest access
    # before the chunk is later than it, and whatever the chunk accessed before this access.
    starts = np.ones(flat.size, dtype=bool)
    starts[1:] = ~same
    firsts = order[starts]
    seen = last[flat[firsts]]
    back = firsts[seen >= 0]
    if back.size:
        acc = np.zeros((back.size, words), dtype=np.uint64)
        step = max(1, _LATER_CELLS // (words * 64))  # [queries, n_expert] a slice at a time
        for q in range(0, back.size, step):
            later = last[None, :] > last[flat[back[q : q + step]]][:, None]
            padded = np.zeros((later.shape[0], words * 64), dtype=bool)
            padded[:, :n_expert] = later
            acc[q : q + step] = np.packbits(padded, axis=1, bitorder="little").view("<u8")
        t_back = back // k
        prefix = np.bitwise_or.accumulate(masks, axis=0)  # tokens 0 .. t of the chunk
        acc |= np.take(before, back, axis=0)
        earlier = t_back > 0
        acc[earlier] |= np.take(prefix, t_back[earlier] - 1, axis=0)
        out[back] = popcount(acc)

    ends = np.ones(flat.size, dtype=bool)
    ends[:-1] = ~same
    new_last = last.copy()
    new_last[flat[order[ends]]] = order[ends] + base
    return out.reshape(tokens, k), new_last


def stack_distances(ids: np.ndarray, n_expert: int, chunk_tokens: int = CHUNK_TOKENS) -> np.ndarray:
    """``[tokens, k] -> [tokens, k]`` int32: the LRU stack distance of each access of one
    layer (router order within a token), ``-1`` for an expert's first access. Works through
    ``chunk_tokens`` tokens at a time."""
    tokens, k = ids.shape
    out = np.full((tokens, k), -1, dtype=np.int32)
    last = np.full(n_expert, -1, dtype=np.int64)
    step = max(1, min(chunk_tokens, bounded_chunk(n_expert, k)))
    for a in range(0, tokens, step):
        b = min(tokens, a + step)
        out[a:b], last = _chunk(np.asarray(ids[a:b]), n_expert, last, a * k)
    return out


def bounded_chunk(n_expert: int, k: int) -> int:
    """Tokens per chunk whose bitmasks and table of ORs stay within ``TABLE_WORDS`` words: a
    chunk holds about ``(17 + 6k)`` words of ``ceil(n_expert / 64)`` per token, so with many
    experts it is fewer tokens (memory follows the trace, not the expert count declared)."""
    words = max(1, -(-n_expert // 64))
    return max(1, TABLE_WORDS // (words * (17 + 6 * k)))


def hit_curve(distances: np.ndarray, n_expert: int) -> np.ndarray:
    """``[n_expert]``: hit rate of an LRU cache of ``1 .. n_expert`` experts over the given
    accesses' distances (cold accesses, ``-1``, miss at every size). NaN when empty."""
    d = np.asarray(distances).ravel()
    if d.size == 0:
        return np.full(n_expert, np.nan)
    warm = d[d >= 0]
    hist = np.bincount(warm, minlength=n_expert)[:n_expert]
    return np.cumsum(hist) / d.size
