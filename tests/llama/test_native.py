"""The prefetcher's C half on real files: the read-ahead thread reads what it is given and
drops what it is told to, and the demand hook's live LRU takes exactly the hits
``replay --policy lru`` models (the registry's LRU), access by access."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import numpy as np
import pytest

from moefixtures import tiny_spec
from moepack.checkpoint.model import MoeModel
from moepack.checkpoint.synth import synth_model
from moepack.llama.prefetcher.evalcb import GgmlTensor, tensor_offsets
from moepack.llama.prefetcher.fetcher import PyFetcher, willneed_window
from moepack.llama.prefetcher.native import CFetcher, CStream, native_library
from moepack.llama.prefetcher.prefetch import ExpertRanges
from moepack.pages import drop_cached
from moepack.storage.linux import PAGE_SIZE, cachestat
from moepack.stream.budget import CacheBudget
from moepack.trace.cache_policy import POLICIES

LIB = native_library()
needs_c = pytest.mark.skipif(LIB is None, reason="no C compiler here")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    spec = tiny_spec(layers=3, experts=16, top_k=4, hidden=256, expert_ffn=256, weight_type="Q8_0")
    return synth_model(tmp_path_factory.mktemp("native") / "m.gguf", spec).paths[0]


def _cached_pages(fd: int, rows: np.ndarray) -> int:
    return sum(cachestat(fd, int(r[2]), int(r[3])).nr_cache for r in rows)


def _pages(rows: np.ndarray) -> int:
    return sum((int(r[2]) + int(r[3]) - 1) // PAGE_SIZE - int(r[2]) // PAGE_SIZE + 1 for r in rows)


def _wait_cached(fd: int, rows: np.ndarray) -> None:
    deadline = time.monotonic() + 120
    while _cached_pages(fd, rows) < _pages(rows):
        assert time.monotonic() < deadline, "the read-ahead never arrived"
        time.sleep(0.01)


@pytest.mark.parametrize("kind", ["c", "python"])
def test_the_read_ahead_thread_reads_what_it_is_given(kind, model):
    if kind == "c" and LIB is None:
        pytest.skip("no C compiler here")
    with MoeModel(model) as m:
        layout = ExpertRanges(m)
    block = layout.blocks[1]
    rows = layout.slice_rows(block, [3, 1, 7])  # any order in: matmul order out
    assert list(rows[:3, 1]) == [1, 3, 7] and len(rows) == 3 * layout.table(block).shape[0]
    fd = os.open(model, os.O_RDONLY)
    try:
        drop_cached(fd)
        fetcher: CFetcher | PyFetcher = (
            CFetcher(LIB, [fd], willneed_window(model), True)
            if LIB is not None and kind == "c"
            else PyFetcher([fd], willneed_window(model), True)
        )
        assert _cached_pages(fd, rows) == 0
        fetcher.demand(block, rows)
        fetcher.wait_idle()
        _wait_cached(fd, rows)
        st = fetcher.stats
        assert st.demand_experts == 3 and st.demand_hits == 0
        assert st.demand_bytes == int(rows[:, 3].sum()) and st.demand_missing > 0
        fetcher.demand(block, rows)  # again: every piece is cached now, nothing is asked
        fetcher.wait_idle()
        again = fetcher.stats
        assert again.demand_hits == 3 and again.demand_missing == st.demand_missing
        assert again.willneed_calls == st.willneed_calls
        fetcher.close()
    finally:
        os.close(fd)


def _topk(name: bytes, ids: np.ndarray, keep: list) -> int:
    """A ggml tensor as llama.cpp hands ``ffn_moe_topk-<il>`` over: I32 ``[k, tokens]``."""
    data = np.ascontiguousarray(ids, dtype=np.int32)
    t = GgmlTensor()
    t.type = 26
    t.buffer = ctypes.addressof(t)  # any non-null buffer: the host check below says yes
    t.ne[:] = [data.shape[1], data.shape[0], 1, 1]
    t.nb[:] = [4, 4 * data.shape[1], 4 * data.size, 4 * data.size]
    t.data = data.ctypes.data
    t.name = name
    keep += [t, data]
    return ctypes.addressof(t)


@needs_c
def test_the_live_cache_hits_exactly_what_replay_lru_models(model):
    assert LIB is not None
    with MoeModel(model) as m:
        layout = ExpertRanges(m)
        k = m.top_k
    blocks = layout.blocks
    rng = np.random.default_rng(4)
    tokens = 300
    # skewed routing with reuse, so hits and evictions both happen
    p = rng.dirichlet(np.full(16, 0.3))
    trace = np.stack(
        [np.stack([rng.choice(16, k, replace=False, p=p) for _ in range(tokens)]) for _ in blocks],
        axis=1,
    )
    budget = CacheBudget(bytes=6 * layout.expert_bytes(blocks[0]) * len(blocks))
    slots = budget.slots_per_layer([layout.expert_bytes(b) for b in blocks], k, [16] * len(blocks))
    fd = os.open(model, os.O_RDONLY)
    host = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(lambda buffer: 1)
    keep: list = [host]
    try:
        fetcher = CFetcher(LIB, [fd], willneed_window(model), True)
        table = [(b, layout.n_expert[b], layout.table(b)) for b in blocks]
        stream = CStream(LIB, fetcher, table, {}, k, 0, -1, tensor_offsets(),
                         ctypes.cast(host, ctypes.c_void_p).value or 0)  # fmt: skip
        stream.set_capacities(slots)
        assert stream.address is not None
        hook = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(
            stream.address
        )
        queued = (ctypes.c_void_p * 8)()
        for t in range(tokens):
            for layer, b in enumerate(blocks):
                hook(
                    stream.handle,
                    _topk(f"ffn_moe_topk-{b}".encode(), trace[t : t + 1, layer], keep),
                    queued,
                )
        fetcher.wait_idle()
        per, calls = stream.stats()
        assert calls["calls"] == tokens * len(blocks) and calls["failures"] == 0
        lru = POLICIES.get("lru")
        for layer, b in enumerate(blocks):
            cache = lru.new_cache(slots[layer], 16, trace[:, layer], None)
            hits = sum(cache.access(int(e)) == -1 for row in trace[:, layer] for e in row)
            assert per[b]["accesses"] == tokens * k
            assert per[b]["cache_hits"] == hits  # access by access, the registry's LRU
            assert per[b]["evictions"] > 0
        assert fetcher.stats.evicted_bytes > 0  # what left the cache left the page cache
        stream.close()
        fetcher.close()
    finally:
        os.close(fd)


def test_pinning_past_the_memlock_limit_is_one_line_saying_what_to_raise(model, request):
    """As a user without CAP_IPC_LOCK, under a 64 KiB RLIMIT_MEMLOCK (root may lock anything:
    the child drops to nobody first)."""
    import subprocess
    import sys

    if os.geteuid() != 0:
        pytest.skip("needs root to become another user")
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="moepack-memlock-"))  # /tmp: nobody can reach it
    request.addfinalizer(lambda: shutil.rmtree(folder, ignore_errors=True))
    copy = folder / "m.gguf"
    copy.write_bytes(model.read_bytes())
    os.chmod(folder, 0o755)
    os.chmod(copy, 0o644)
    code = (
        "import os, resource, sys\n"
        "from moepack.checkpoint.model import MoeModel\n"
        "from moepack.errors import BadInput\n"
        "from moepack.llama.prefetcher.pinning import dense_ranges, pin\n"
        f"m = MoeModel({str(copy)!r}); ranges = dense_ranges(m)\n"
        "resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, 65536))\n"
        "os.setgid(65534); os.setuid(65534)  # no CAP_IPC_LOCK from here on\n"
        "try:\n"
        "    pin(m.shard_paths, ranges)\n"
        "except BadInput as e:\n"
        "    print(e); sys.exit(0)\n"
        "sys.exit(1)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    line = p.stdout.strip()
    assert "\n" not in line and "RLIMIT_MEMLOCK is 65,536 bytes" in line
    assert "raise it to at least" in line and "ulimit -l" in line
