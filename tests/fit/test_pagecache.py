"""The page-cache replay behaves as the kernel's lists do: what fits stays, read-around
pages nobody touches go before the experts a token uses, a sequential scan faults once and
reads ahead, and windows stay inside their file."""

from __future__ import annotations

from collections import OrderedDict

from moepack.fit.pagecache import replay, replay_unit

STRIDE = 1 << 40
LIMITS = {0: (0, 10_000)}


def _run(
    tokens: list[list[tuple[int, int]]], cache_units: int, window_units: int
) -> tuple[float, float]:
    r = replay(
        tokens + tokens, cache_units, window_units, 1, LIMITS, len(tokens), shard_stride=STRIDE
    )
    return r.faults, r.read_units


def _lru_of_windows(tokens: list[list[tuple[int, int]]], capacity: int, window: int) -> list[int]:
    cache: OrderedDict[int, None] = OrderedDict()
    out = []
    for ranges in tokens:
        misses = 0
        for first, _ in ranges:
            w = first // window
            if w in cache:
                cache.move_to_end(w)
                continue
            misses += 1
            cache[w] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
        out.append(misses)
    return out


def test_what_fits_stays() -> None:
    tokens = [[(u, u) for u in range(0, 2000, 40)] for _ in range(4)]
    faults, reads = _run(tokens, cache_units=4000, window_units=16)
    assert faults == 0 and reads == 0


def test_untouched_read_around_goes_before_the_experts_a_token_uses() -> None:
    # 50 one-unit slices 40 units apart: each fault reads 16 units, 15 of them never used.
    # A token's windows (800 units) do not fit in the cache: one LRU of them would fault on
    # every slice of every token; the two lists keep the slices, touched once a token.
    tokens = [[(u, u) for u in range(0, 2000, 40)] for _ in range(8)]
    faults, _ = _run(tokens, cache_units=600, window_units=16)
    assert faults == 0
    assert _lru_of_windows(tokens + tokens, 600 // 16, 16)[len(tokens) :] == [50] * len(tokens)


def test_a_cache_smaller_than_a_token_streams() -> None:
    tokens = [[(u, u) for u in range(0, 2000, 40)] for _ in range(8)]
    faults, reads = _run(tokens, cache_units=30, window_units=16)
    assert faults >= 40 and reads >= 40 * 15


def test_a_sequential_scan_faults_once_and_reads_ahead() -> None:
    tokens = [[(0, 999)]]
    r = replay(tokens, 100_000, 32, 1, LIMITS, 0, shard_stride=STRIDE)
    assert r.faults == 1
    assert 1000 <= r.read_units <= 1000 + 2 * 32  # ahead by at most a window or two


def test_windows_stay_inside_the_file() -> None:
    limits = {0: (0, 100), 1: (STRIDE, STRIDE + 50)}
    tokens = [[(0, 0), (99, 99), (STRIDE + 49, STRIDE + 49)]]
    r = replay(tokens, 10_000, 64, 1, limits, 0, shard_stride=STRIDE)
    assert r.read_units <= 150


def test_the_unit_grows_with_the_model_and_stays_below_a_window() -> None:
    assert replay_unit(300 << 20, 8 << 20) == 128 << 10
    big = replay_unit(8 << 30, 8 << 20)
    assert (128 << 10) < big <= (8 << 20) // 8 and big % 4096 == 0
