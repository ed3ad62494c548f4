"""The prefetcher's native half: the read-ahead thread and the demand hook, in C.

Both run where Python would cost the decode time it is meant to save:

- **the read-ahead thread** (``moepack_fetcher_*``): demand and speculation queues; each
  piece looked up with ``cachestat`` and, when something is missing, asked for with
  ``POSIX_FADV_WILLNEED`` in windows the kernel takes whole (see ``fetcher``). A Python
  thread would hold the GIL between its system calls, and the eval callback, which runs on
  the thread that computes, would wait for it.
- **the demand hook** (``moepack_stream_*``): called by the eval gate (``evalgate``) on every
  read of ``ffn_moe_topk-<il>``, before Python and usually instead of it. It reads the top-k
  ids, queues the chosen slices in the order the layer's matmuls read them, judges what was
  speculated for this layer, and speculates for the next ``depth`` layers: all their experts
  when the pass is long enough to touch them all (prefill), else each token's best by the
  next layer's router applied to this layer's router input (pre-gating, see ``lookahead``),
  as many as the budget and the layer's measured precision allow. In Python the same work
  cost ~0.9 ms per layer inside the callback (numpy calls there cost ~12 µs each); here it
  is a few microseconds.

The C is ``csrc/stream.c``, built once per source and compiler by ``cbuild``; without a C compiler the Python versions run
(``fetcher.PyFetcher``, the handler in ``streamer``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np

from ...storage.linux import PAGE_SIZE
from .cbuild import compile_library


@dataclass
class FetchStats:
    """What the thread asked the kernel for, summed (bytes, pieces, nanoseconds)."""

    demand_experts: int = 0  # experts chosen (each once per layer and pass)
    demand_hits: int = 0  # of those, every byte already in the page cache
    demand_pieces: int = 0
    demand_bytes: int = 0  # bytes of the pieces given as demand
    demand_missing: int = 0  # of those, not in the page cache when looked up: read
    spec_pieces: int = 0
    spec_bytes: int = 0
    spec_missing: int = 0  # speculative bytes read
    spec_dropped: int = 0  # speculative pieces dropped unsent (the real choice came first)
    willneed_calls: int = 0  # WILLNEED calls made
    ns_submitting: int = 0  # time inside WILLNEED calls (blocked on the device queue too)
    errors: int = 0  # WILLNEED calls the kernel refused (the fault path then reads)
    evicted_pieces: int = 0  # slices dropped from the page cache (the live cache's victims)
    evicted_bytes: int = 0

    def to_json(self) -> dict[str, int | float]:
        d: dict[str, int | float] = dict(asdict(self))
        d["seconds_submitting"] = self.ns_submitting / 1e9
        return d


class _CStats(ctypes.Structure):
    """``struct stats`` of the C source: FetchStats' fields in order, all int64 (the C side
    checks the size it is given: ``moepack_fetcher_stats`` takes it)."""

    _fields_ = [(f.name, ctypes.c_int64) for f in fields(FetchStats)]


def native_library() -> ctypes.CDLL | None:
    """The compiled helpers with their signatures declared, or None (no C compiler)."""
    lib = compile_library("stream", flags=("-pthread",))
    if lib is None:
        return None
    lib.moepack_fetcher_new.argtypes = [
        ctypes.POINTER(ctypes.c_int),
        ctypes.c_int,
        ctypes.c_int64,
        ctypes.c_int,
    ]
    lib.moepack_fetcher_new.restype = ctypes.c_void_p
    lib.moepack_fetcher_push.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int32,
        ctypes.c_int32,
        ctypes.c_void_p,
        ctypes.c_int64,
    ]
    lib.moepack_fetcher_push.restype = ctypes.c_int
    lib.moepack_fetcher_wait_idle.argtypes = [ctypes.c_void_p]
    lib.moepack_fetcher_wait_idle.restype = None
    lib.moepack_fetcher_stats.argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(_CStats),
        ctypes.c_int64,
    ]
    lib.moepack_fetcher_stats.restype = ctypes.c_int
    lib.moepack_fetcher_drain.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.moepack_fetcher_drain.restype = ctypes.c_int64
    lib.moepack_fetcher_free.argtypes = [ctypes.c_void_p]
    lib.moepack_fetcher_free.restype = None
    vp, i32 = ctypes.c_void_p, ctypes.c_int
    lib.moepack_stream_new.argtypes = [vp, i32, i32, i32, i32, i32, i32, vp, vp]
    lib.moepack_stream_new.restype = vp
    lib.moepack_stream_block.argtypes = [vp, i32, i32, i32, i32, vp, vp, vp, vp]
    lib.moepack_stream_block.restype = i32
    lib.moepack_stream_scratch.argtypes = [vp, i32]
    lib.moepack_stream_scratch.restype = i32
    lib.moepack_stream_stats.argtypes = [vp, vp, ctypes.c_int64]
    lib.moepack_stream_stats.restype = i32
    lib.moepack_stream_cache.argtypes = [vp, i32, i32]
    lib.moepack_stream_cache.restype = i32
    lib.moepack_fetcher_map.argtypes = [vp, i32, ctypes.c_int64, ctypes.c_int64]
    lib.moepack_fetcher_map.restype = None
    lib.moepack_stream_free.argtypes = [vp]
    lib.moepack_stream_free.restype = None
    return lib


class CFetcher:
    """The read-ahead thread in C (see the module docstring); the same calls as
    ``PyFetcher``."""

    kind = "c"

    def __init__(self, lib: ctypes.CDLL, fds: Sequence[int], window: int, cachestat_works: bool):
        self._lib = lib
        arr = (ctypes.c_int * len(fds))(*fds)
        self.window = max(PAGE_SIZE, window // PAGE_SIZE * PAGE_SIZE)
        handle = lib.moepack_fetcher_new(arr, len(fds), self.window, int(cachestat_works))
        if not handle:
            raise OSError("could not start the read-ahead thread")
        self._handle: int | None = handle

    def _push(self, layer: int, rows: np.ndarray, spec: bool) -> None:
        assert self._handle is not None
        rows = np.ascontiguousarray(rows, dtype=np.int64).reshape(-1, 4)
        if self._lib.moepack_fetcher_push(
            self._handle, layer, int(spec), rows.ctypes.data, rows.shape[0]
        ):
            raise MemoryError("the read-ahead thread could not queue its work")

    def demand(self, layer: int, rows: np.ndarray) -> None:
        self._push(layer, rows, False)

    def speculate(self, layer: int, rows: np.ndarray) -> None:
        if len(rows):
            self._push(layer, rows, True)

    def wait_idle(self) -> None:
        if self._handle is not None:
            self._lib.moepack_fetcher_wait_idle(self._handle)

    @property
    def stats(self) -> FetchStats:
        out = _CStats()
        handle = self._handle
        if handle is not None and self._lib.moepack_fetcher_stats(
            handle, ctypes.byref(out), ctypes.sizeof(out)
        ):
            raise RuntimeError("the read-ahead thread's counters do not match")
        return FetchStats(*(int(getattr(out, f.name)) for f in fields(FetchStats)))

    def set_mapping(self, shard: int, address: int, length: int) -> None:
        """Where llama.cpp maps ``shard`` (evictions unmap pages there first)."""
        if self._handle is not None:
            self._lib.moepack_fetcher_map(self._handle, shard, address, length)

    def drain_spec(self) -> list[tuple[int, int, int]]:
        """(layer, expert, bytes read) of the speculative pieces sent since the last call."""
        if self._handle is None:
            return []
        out: list[tuple[int, int, int]] = []
        buf = np.empty((1024, 3), dtype=np.int64)
        while n := self._lib.moepack_fetcher_drain(self._handle, buf.ctypes.data, 1024):
            out.extend((int(a), int(b), int(c)) for a, b, c in buf[:n])
        return out

    def close(self) -> None:
        if self._handle is not None:
            self._lib.moepack_fetcher_free(self._handle)
            self._handle = None


_BLOCK_KEYS = (
    "predicted",
    "hits",
    "chosen",
    "bytes_read",
    "bytes_wasted",
    "accesses",
    "cache_hits",
    "evictions",
    "union_experts",
    "routed",
)


class CStream:
    """The demand hook over ``fetcher`` for the MoE blocks of ``table`` (see the module
    docstring). ``blocks``: per MoE block in graph order ``(index, n_expert, slices)`` with
    ``slices`` int64 ``[tensors, 3]`` (shard, base, slice bytes) in the order the matmuls
    read them; ``router``: per block index ``(weights [n_expert, dim], norm or None, bias or
    None)`` float32 for pre-gating (empty: no lookahead by router). ``depth`` 0: no
    lookahead at all. ``router_slot``: the gate's queue entry holding ``ffn_moe_logits``."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        fetcher: CFetcher,
        blocks: Sequence[tuple[int, int, np.ndarray]],
        router: dict[int, tuple[np.ndarray, np.ndarray | None, np.ndarray | None]],
        budget: int,
        depth: int,
        router_slot: int,
        tensor_offsets: Sequence[int],
        is_host: int,
    ) -> None:
        self._lib = lib
        self._keep: list[np.ndarray] = []  # arrays the C side points into
        dims = {w.shape[1] for w, _n, _b in router.values()}
        dim = dims.pop() if len(dims) == 1 else 0
        offsets = (ctypes.c_int * 7)(*tensor_offsets)
        assert fetcher._handle is not None
        handle = lib.moepack_stream_new(
            fetcher._handle,
            len(blocks),
            max(b[0] for b in blocks),
            dim,
            budget,
            depth,
            router_slot,
            offsets,
            is_host,
        )
        if not handle:
            raise MemoryError("could not set up the prefetcher's demand hook")
        self._handle: int | None = handle
        self.blocks = [b[0] for b in blocks]
        for pos, (index, n_expert, slices) in enumerate(blocks):
            table = self._pin(np.ascontiguousarray(slices, dtype=np.int64))
            w = norm = bias = None
            if dim and index in router:
                rw, rn, rb = router[index]
                w = self._pin(np.ascontiguousarray(rw, dtype=np.float32))
                norm = (
                    self._pin(np.ascontiguousarray(rn, dtype=np.float32))
                    if rn is not None
                    else None
                )
                bias = (
                    self._pin(np.ascontiguousarray(rb, dtype=np.float32))
                    if rb is not None
                    else None
                )
            rc = lib.moepack_stream_block(
                handle,
                pos,
                index,
                n_expert,
                table.shape[0],
                table.ctypes.data,
                w.ctypes.data if w is not None else None,
                norm.ctypes.data if norm is not None else None,
                bias.ctypes.data if bias is not None else None,
            )
            if rc:
                self.close()
                raise ValueError(f"block {index}: more expert matrices than the hook takes")
        if lib.moepack_stream_scratch(handle, 0):
            self.close()
            raise MemoryError("could not set up the prefetcher's demand hook")
        self.address = ctypes.cast(lib.moepack_stream_on_topk, ctypes.c_void_p).value

    def set_capacities(self, slots: Sequence[int]) -> None:
        """Experts each block's live LRU holds (0: none, the kernel decides); empties it."""
        assert self._handle is not None
        for pos, n in enumerate(slots):
            if self._lib.moepack_stream_cache(self._handle, pos, int(n)):
                raise MemoryError("could not set up the live expert cache")

    @property
    def handle(self) -> int:
        assert self._handle is not None
        return self._handle

    def _pin(self, a: np.ndarray) -> np.ndarray:
        self._keep.append(a)
        return a

    def stats(self) -> tuple[dict[int, dict[str, int]], dict[str, int]]:
        """Per block ``predicted, hits, chosen, bytes_read, bytes_wasted``, the live cache's
        ``accesses, cache_hits, evictions``, ``union_experts`` (distinct chosen experts,
        summed over passes) and ``routed`` (rows x top-k); and the hook's
        ``calls, passes, ns, failures``."""
        w = len(_BLOCK_KEYS)
        out = np.zeros(w * len(self.blocks) + 4, dtype=np.int64)
        if self._handle is not None and self._lib.moepack_stream_stats(
            self._handle, out.ctypes.data, out.size
        ):
            raise RuntimeError("the demand hook's counters do not match")
        per = {
            b: {k: int(out[w * i + j]) for j, k in enumerate(_BLOCK_KEYS)}
            for i, b in enumerate(self.blocks)
        }
        tail = out[w * len(self.blocks) :]
        return per, dict(zip(("calls", "passes", "ns", "failures"), map(int, tail), strict=True))

    def close(self) -> None:
        if self._handle is not None:
            self._lib.moepack_stream_free(self._handle)
            self._handle = None
