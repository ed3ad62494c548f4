"""The KV state of recent prompts kept across requests, so that a conversation another
request came between does not pay its whole prompt again.

llama-cpp-python keeps one sequence: a request that shares less of it (an agent's side
request, a second user) has the rest thrown away, and the next turn of the long conversation
is computed again from its first token. Here, the served ``Llama``'s ``generate`` is wrapped
(``PrefixCache.install``, under the meter) to do three things around llama-cpp-python's own:

- before a prompt runs, the live sequence it would throw away is saved (when at least
  ``MIN_TOKENS`` of it are not in the cache already): the save is paid only when a prompt
  leaves the sequence, never while one conversation goes on;
- the longest cached prefix of the prompt is restored when it beats what the live sequence
  keeps by ``MIN_TOKENS``, and llama-cpp-python's own prefix match then keeps it and
  evaluates only the rest, exactly as for its own sequence (so the reused tokens have one
  meaning: the prompt less the tokens evaluated);
- on a model with recurrent state (qwen3next, qwen35moe: the delta-net layers' state is of
  the last position only, and llama.cpp refuses to cut it shorter), an entry can only be
  restored whole, as a strict prefix of the prompt. Its prompt's state is saved once the
  first token is out (the next turn starts with this prompt, not necessarily with the text
  generated after it, which a chat template may render otherwise).

An entry is llama.cpp's state of sequence 0 (``llama_state_seq_get_data``: the KV cells, and
the recurrent state where the model has one, no logits) in a numpy buffer, with its token
ids. Entries are kept LRU within ``budget`` bytes (states and token ids): room is made
before a state is copied, so the cache never holds more; a state larger than the whole
budget is not kept. A new entry that holds all but ``MIN_TOKENS`` of an older one (the next
turn of the same conversation) replaces it. The prefix is found by comparing the prompt with
each entry's tokens (numpy, a few microseconds per entry).

A request that asks for its prompt's log-probabilities (``echo`` with ``logprobs``) is never
given a restored prefix: llama-cpp-python reads those from its score rows, which a restore
does not bring back.
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .server import ServeOptions

DEFAULT_BYTES = 2 << 30
"""``--prefix-cache`` by default: one 20k-token conversation of Qwen3-30B-A3B (96 KiB a
token at F16) and its side requests."""
MIN_TOKENS = 32
"""The least worth keeping: shorter states are not saved, a restore must win this many tokens
over the live sequence, and a new entry replaces an old one it covers but for this many."""


def budget_bytes(options: ServeOptions) -> int:
    """The most memory the prefix cache of a server run with ``options`` takes (0: off):
    the one place a memory budget of the server reads it from."""
    return max(0, int(options.prefix_cache))


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


@dataclass
class Entry:
    """One kept state: the tokens of sequence 0 and llama.cpp's bytes of it. ``whole``: the
    state holds recurrent layers and can only be used whole."""

    tokens: np.ndarray
    state: np.ndarray
    whole: bool

    @property
    def nbytes(self) -> int:
        return int(self.state.nbytes + self.tokens.nbytes)

    def usable(self, prompt: np.ndarray) -> int:
        """How many of ``prompt``'s tokens this entry gives (at least one is left to
        evaluate, whose logits the first token is sampled from)."""
        return usable(self.tokens, prompt, self.whole)


def usable(tokens: np.ndarray, prompt: np.ndarray, whole: bool) -> int:
    """The prefix of ``prompt`` a state of ``tokens`` gives: the shared tokens but the last
    of the prompt, or, when the state is ``whole``, all of ``tokens`` if they are a strict
    prefix of the prompt, else nothing."""
    shared = common_prefix(tokens, prompt)
    if whole:
        return len(tokens) if shared == len(tokens) < len(prompt) else 0
    return min(shared, len(prompt) - 1)


class PrefixStore:
    """Entries within a byte budget, least recently used first out (no llama.cpp here)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self.bytes = 0
        self.evicted = 0
        self._ids = 0

    def best(self, prompt: np.ndarray) -> tuple[Entry | None, int]:
        """The entry giving the longest prefix of ``prompt``, and that prefix's length."""
        found, length = None, 0
        for entry in self.entries.values():
            n = entry.usable(prompt)
            if n > length:
                found, length = entry, n
        return found, length

    def covered(self, tokens: np.ndarray) -> int:
        """How many leading ``tokens`` some entry already holds."""
        best = 0
        for e in self.entries.values():
            shared = common_prefix(e.tokens, tokens)
            if e.whole and shared < len(e.tokens):
                continue
            best = max(best, shared)
        return best

    def touch(self, entry: Entry) -> None:
        for key, e in self.entries.items():
            if e is entry:
                self.entries.move_to_end(key)
                return

    def make_room(self, nbytes: int, keep: Entry | None = None) -> bool:
        """Evict least recently used entries (never ``keep``) until ``nbytes`` more fit;
        False (nothing evicted) when they cannot."""
        others = sum(e.nbytes for e in self.entries.values() if e is not keep)
        held = self.bytes - others
        if nbytes + held > self.budget:
            return False
        for key in list(self.entries):
            if self.bytes + nbytes <= self.budget:
                break
            if self.entries[key] is not keep:
                self._drop(key)
                self.evicted += 1
        return True

    def add(self, entry: Entry, keep: Entry | None = None) -> None:
        """Keep ``entry`` (room made for it already), replacing the entries it covers but
        for ``MIN_TOKENS`` (never ``keep``)."""
        for key, e in list(self.entries.items()):
            if e is keep:
                continue
            shared = common_prefix(e.tokens, entry.tokens)
            same = shared == len(e.tokens) == len(entry.tokens)
            if same or (not e.whole and not entry.whole and shared + MIN_TOKENS >= len(e.tokens)):
                self._drop(key)
        self._ids += 1
        self.entries[self._ids] = entry
        self.bytes += entry.nbytes

    def _drop(self, key: int) -> None:
        self.bytes -= self.entries.pop(key).nbytes


@dataclass
class PrefixCounts:
    """What the cache did, for ``/metrics``."""

    saved: int = 0
    restored: int = 0
    restored_tokens: int = 0
    refused: int = 0  # states larger than the budget, or than the room beside the one restored
    failed: int = 0  # states llama.cpp did not give or take back
    save_ns: int = 0
    restore_ns: int = 0
    saved_bytes: int = 0
    restored_bytes: int = 0


class PrefixCache:
    """The prefix cache of one served ``Llama`` (see the module docstring)."""

    def __init__(self, llm: Any, budget: int) -> None:
        import llama_cpp

        self.llm = llm
        self.store = PrefixStore(budget)
        self.counts = PrefixCounts()
        model = llm.model
        self.whole = bool(
            llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model)
        )
        self._lock = threading.Lock()  # the entries and counts, against /metrics
        self._local = threading.local()  # the completion in this thread wants prompt logprobs
        self._generate = llm.generate
        self._create = llm.create_completion

    def install(self) -> None:
        """Keep prefixes from now on (the instance's ``generate`` and ``create_completion``
        wrapped: install it before the meter, which then measures what it saves)."""
        self.llm.generate = self.generate
        self.llm.create_completion = self.create_completion

    # -- wrapped methods -------------------------------------------------------------------

    def create_completion(self, *args: Any, **kwargs: Any) -> Any:
        """``Llama.create_completion``: notes whether the prompt's logprobs are asked for
        (a stream's generator runs later: its flag is set when it starts)."""
        prompt_logprobs = bool(kwargs.get("echo")) and kwargs.get("logprobs") is not None
        if kwargs.get("stream"):
            return self._streamed(prompt_logprobs, self._create(*args, **kwargs))
        self._local.prompt_logprobs = prompt_logprobs
        try:
            return self._create(*args, **kwargs)
        finally:
            self._local.prompt_logprobs = False

    def _streamed(self, prompt_logprobs: bool, chunks: Any) -> Any:
        self._local.prompt_logprobs = prompt_logprobs
        try:
            yield from chunks
        finally:
            self._local.prompt_logprobs = False

    def generate(
        self, tokens: Sequence[int], *args: Any, **kwargs: Any
    ) -> Generator[int, Sequence[int] | None, None]:
        """``Llama.generate`` with the live sequence saved before it is left and the longest
        cached prefix restored; on a model with recurrent state, the prompt's state saved
        after the first token."""
        if args or not kwargs.get("reset", True):  # not a request's prompt: llama-cpp-python's
            yield from self._generate(tokens, *args, **kwargs)
            return
        prompt = np.asarray(list(tokens), dtype=np.intc)
        self._prepare(prompt, restore=not getattr(self._local, "prompt_logprobs", False))
        inner = self._generate(tokens, *args, **kwargs)
        pending = self.whole and len(prompt) >= MIN_TOKENS  # the prompt's state, once computed
        yielded = False
        try:
            sent: Sequence[int] | None = None
            while True:
                try:
                    token = inner.send(sent) if sent is not None else next(inner)
                except StopIteration:
                    return
                yielded = True
                sent = yield token
                if pending:
                    pending = False
                    self._checkpoint(prompt)
        finally:
            inner.close()
            if pending and yielded:
                self._checkpoint(prompt)

    # -- the cache ---------------------------------------------------------------------------

    def _live(self) -> np.ndarray:
        return np.array(self.llm.input_ids[: self.llm.n_tokens], dtype=np.intc)

    def _prepare(self, prompt: np.ndarray, restore: bool) -> None:
        """Before llama-cpp-python's own prefix match: save what it would throw away, and
        put the best cached prefix in place when it beats the live sequence's."""
        live = self._live()
        kept = usable(live, prompt, self.whole) if len(live) else 0
        with self._lock:
            entry, length = self.store.best(prompt) if restore else (None, 0)
        if entry is not None and length < kept + MIN_TOKENS:
            entry = None
        if entry is not None:
            kept = 0  # the live sequence is replaced
        with self._lock:
            covered = self.store.covered(live) if len(live) else 0
        if len(live) - max(kept, covered) >= MIN_TOKENS:
            self._save(live, keep=entry)
        if entry is not None:
            self._restore(entry, length)

    def _checkpoint(self, prompt: np.ndarray) -> None:
        """The state of exactly ``prompt`` (its first token sampled, not yet evaluated)."""
        if self.llm.n_tokens != len(prompt) or common_prefix(self._live(), prompt) < len(prompt):
            return
        with self._lock:
            for e in self.store.entries.values():
                if len(e.tokens) == len(prompt) and common_prefix(e.tokens, prompt) == len(prompt):
                    self.store.touch(e)
                    return
        self._save(prompt.copy())

    def _save(self, tokens: np.ndarray, keep: Entry | None = None) -> None:
        """Copy sequence 0's state (of ``tokens``) into the cache."""
        import llama_cpp

        ctx = self.llm._ctx.ctx
        n = len(tokens)
        mem = llama_cpp.llama_get_memory(ctx)
        if not self.whole:
            llama_cpp.llama_memory_seq_rm(mem, 0, n, -1)  # cells past the tokens (a stale draft)
        if llama_cpp.llama_memory_seq_pos_max(mem, 0) != n - 1:
            with self._lock:
                self.counts.failed += 1
            return
        t0 = perf_counter_ns()
        size = int(llama_cpp.llama_state_seq_get_size(ctx, 0))
        with self._lock:
            if not self.store.make_room(size + tokens.nbytes, keep=keep):
                self.counts.refused += 1
                return
        try:
            state = np.empty(size, dtype=np.uint8)
        except MemoryError:
            with self._lock:
                self.counts.failed += 1
            return
        got = int(
            llama_cpp.llama_state_seq_get_data(
                ctx, state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, 0
            )
        )
        if got == 0 or got > size:
            with self._lock:
                self.counts.failed += 1
            return
        entry = Entry(tokens, state if got == size else state[:got].copy(), self.whole)
        with self._lock:
            self.store.add(entry, keep=keep)
            c = self.counts
            c.saved += 1
            c.saved_bytes += got
            c.save_ns += perf_counter_ns() - t0

    def _restore(self, entry: Entry, length: int) -> None:
        """Put ``entry`` in sequence 0 and tell llama-cpp-python it holds its tokens (its own
        prefix match then cuts it to ``length`` and evaluates the rest)."""
        import llama_cpp

        llm = self.llm
        ctx = llm._ctx.ctx
        t0 = perf_counter_ns()
        size = int(entry.state.nbytes)
        got = int(
            llama_cpp.llama_state_seq_set_data(
                ctx, entry.state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, 0
            )
        )
        n = len(entry.tokens)
        mem = llama_cpp.llama_get_memory(ctx)
        if got != size or llama_cpp.llama_memory_seq_pos_max(mem, 0) != n - 1:
            # nothing of it can be trusted: the prompt is computed from its first token
            llama_cpp.llama_memory_clear(mem, True)
            llm.n_tokens = 0
            llm._requires_eval = True
            with self._lock:
                self.counts.failed += 1
            return
        llm.input_ids[:n] = entry.tokens
        llm.n_tokens = n
        llm._requires_eval = True  # the logits are not the state's: a token is evaluated
        with self._lock:
            self.store.touch(entry)
            c = self.counts
            c.restored += 1
            c.restored_tokens += length
            c.restored_bytes += size
            c.restore_ns += perf_counter_ns() - t0

    # -- what /metrics reads -----------------------------------------------------------------

    def snapshot(self) -> dict[str, float]:
        """The budget, what is held now and what the cache did so far."""
        with self._lock:
            c = self.counts
            return {
                "budget_bytes": float(self.store.budget),
                "bytes": float(self.store.bytes),
                "entries": float(len(self.store.entries)),
                "saved": float(c.saved),
                "restored": float(c.restored),
                "evicted": float(self.store.evicted),
                "refused": float(c.refused),
                "failed": float(c.failed),
                "restored_tokens": float(c.restored_tokens),
                "save_seconds": c.save_ns / 1e9,
                "restore_seconds": c.restore_ns / 1e9,
                "saved_bytes": float(c.saved_bytes),
                "restored_bytes": float(c.restored_bytes),
            }


def prefix_cache(llm: Any, budget: int) -> PrefixCache | None:
    """The prefix cache of ``llm`` within ``budget`` bytes, installed (None when 0: off)."""
    if budget <= 0:
        return None
    cache = PrefixCache(llm, budget)
    cache.install()
    return cache


Samples = list[tuple[tuple[str, ...], float]]

FAMILIES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    (
        "moepack_prefix_cache_budget_bytes",
        "gauge",
        "The prefix cache's budget (--prefix-cache).",
        (),
    ),
    (
        "moepack_prefix_cache_bytes",
        "gauge",
        "Bytes the prefix cache holds now (KV states and their token ids).",
        (),
    ),
    ("moepack_prefix_cache_entries", "gauge", "Prompt states the prefix cache holds now.", ()),
    (
        "moepack_prefix_cache_ops",
        "counter",
        "States saved, restored, evicted (least recently used), refused (larger than the "
        "room) and failed (llama.cpp did not give or take them).",
        ("op",),
    ),
    (
        "moepack_prefix_cache_restored_tokens",
        "counter",
        "Prompt tokens restored from the prefix cache (counted in the reused tokens too).",
        (),
    ),
    (
        "moepack_prefix_cache_seconds",
        "counter",
        "Time copying states into and out of the prefix cache.",
        ("op",),
    ),
    ("moepack_prefix_cache_copied_bytes", "counter", "State bytes copied, per direction.", ("op",)),
)
"""The prefix cache's metric families (name, kind, help, labels), for ``metrics.FAMILIES``."""


def samples(snapshot: Callable[[], dict[str, float]] | None) -> dict[str, Samples]:
    """The families' samples now (none without a cache)."""
    if snapshot is None:
        return {}
    s = snapshot()
    ops = ("saved", "restored", "evicted", "refused", "failed")
    return {
        "moepack_prefix_cache_budget_bytes": [((), s["budget_bytes"])],
        "moepack_prefix_cache_bytes": [((), s["bytes"])],
        "moepack_prefix_cache_entries": [((), s["entries"])],
        "moepack_prefix_cache_ops": [((op,), s[op]) for op in ops],
        "moepack_prefix_cache_restored_tokens": [((), s["restored_tokens"])],
        "moepack_prefix_cache_seconds": [
            (("save",), s["save_seconds"]),
            (("restore",), s["restore_seconds"]),
        ],
        "moepack_prefix_cache_copied_bytes": [
            (("save",), s["saved_bytes"]),
            (("restore",), s["restored_bytes"]),
        ],
    }
