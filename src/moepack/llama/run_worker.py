"""Runs inside a child process: greedy generation in llama.cpp, optionally with the expert
prefetcher in the eval callback, measured per phase (prefill, decode).

llama.cpp aborts the whole process on some bad inputs, so the parent never loads a model. The
child talks to its parent through one pipe of JSON lines: ``{"warning": …}``, ``{"piece": …}``
per generated token, then ``{"result": …}`` or ``{"error": …}``.

Usage: python -m moepack.llama.run_worker CONFIG_JSON EVENT_FD
"""

from __future__ import annotations

import codecs
import ctypes
import json
import os
import resource
import sys
from pathlib import Path
from time import perf_counter_ns
from typing import IO, Any

import numpy as np

from ..errors import BadInput
from .prefetch import FileIdentity, Prefetcher, PrefetchStats
from .readaround import no_readaround
from .threadpool import ThreadPool
from .topk_hook import TopkHook


def counters() -> dict[str, int]:
    """This process's fault, I/O and CPU counters (all threads): getrusage and /proc/self/io."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out = {
        "major_faults": int(ru.ru_majflt),
        "minor_faults": int(ru.ru_minflt),
        "cpu_ns": int((ru.ru_utime + ru.ru_stime) * 1e9),
    }
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("read_bytes", "syscr", "rchar"):
                out[key] = int(value)
    except OSError:
        pass
    return out


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def _stats_delta(after: PrefetchStats, before: PrefetchStats) -> dict[str, int | float]:
    a, b = after.to_json(), before.to_json()
    return {k: a[k] - b[k] for k in a}


class Events:
    """JSON lines to the parent."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def send(self, **event: Any) -> None:
        self.stream.write(json.dumps(event) + "\n")
        self.stream.flush()


def _quiet_logs(llama_cpp: Any) -> Any:
    def ignore(level: int, text: bytes, user_data: int) -> None:
        return None

    cb = llama_cpp.llama_log_callback(ignore)
    llama_cpp.llama_log_set(cb, ctypes.c_void_p(0))
    return cb  # keep referenced


def _tokenize(llama_cpp: Any, vocab: Any, text: str, path: str) -> list[int]:
    raw = text.encode()
    cap = len(raw) + 16
    buf = (llama_cpp.llama_token * cap)()
    n = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, cap, True, False)
    if n < 0:
        cap = -n
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, cap, True, False)
    if n <= 0:
        raise BadInput("the prompt gives no tokens", path)
    return list(buf[:n])


def _piece(llama_cpp: Any, vocab: Any, token: int) -> bytes:
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, False)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, False)
    return buf.raw[: max(n, 0)]


class Generation:
    """One model loaded with one context; greedy decoding with per-phase measurements."""

    def __init__(self, cfg: dict[str, Any], events: Events) -> None:
        import llama_cpp

        self.ll = llama_cpp
        self.cfg = cfg
        self.events = events
        self.path = cfg["model"]
        self._log_cb = _quiet_logs(llama_cpp)
        llama_cpp.llama_backend_init()
        self.identities = [FileIdentity(*i) for i in cfg["identities"]]
        self._check_identity()
        self.prefetcher: Prefetcher | None = None
        self.routing: list[tuple[int, np.ndarray]] = []
        self.hook: TopkHook | None = None
        if cfg["prefetch"]:
            from ..checkpoint.model import MoeModel

            model = MoeModel(self.path)
            self.prefetcher = Prefetcher(model, cfg["engine"], cfg["queue_depth"], self.identities)
            model.close()
            if self.prefetcher.choice.warning:
                events.send(warning=self.prefetcher.choice.warning)
        if cfg["prefetch"] or cfg["trace"]:
            self.hook = TopkHook(self._on_topk)
        mp = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(self.path.encode(), mp)
        if not self.model:
            raise BadInput("llama.cpp could not load this model", self.path)
        self.readaround_bytes = 0
        if cfg["no_readaround"]:
            from ..checkpoint.model import MoeModel

            with MoeModel(self.path) as m:
                self.readaround_bytes = no_readaround(m)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.tokens = _tokenize(llama_cpp, self.vocab, cfg["prompt"], self.path)
        n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(self.model))
        need = len(self.tokens) + cfg["n_predict"] + 1
        if need > n_ctx_train:
            raise BadInput(
                f"prompt ({len(self.tokens)} tokens) plus --n-predict {cfg['n_predict']} "
                f"exceeds the model's context of {n_ctx_train} tokens",
                self.path,
            )
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = need
        cp.n_batch = cp.n_ubatch = min(cfg["batch"], len(self.tokens))
        cp.n_threads = cp.n_threads_batch = cfg["threads"]
        if self.hook is not None:
            cp.cb_eval = self.hook.callback
            cp.cb_eval_user_data = None
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise BadInput("llama.cpp could not create a context for this model", self.path)
        self.threadpool = ThreadPool(llama_cpp, self.ctx, cfg["threads"])
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.logits: list[np.ndarray] = []
        self._decoding = False

    def _check_identity(self) -> None:
        for shard, ident in zip(_shards_of(self.path), self.identities, strict=True):
            if FileIdentity.of(shard) != ident:
                raise BadInput("the model file changed since it was opened", shard)

    def _on_topk(self, layer: int, ids: np.ndarray) -> None:
        if self.prefetcher is not None:
            self.prefetcher.prefetch(layer, np.unique(ids).tolist())
        if self.cfg["trace"]:
            self.routing.append((layer, ids))

    def _decode(self, tokens: list[int], pos: int, want_logits: bool) -> None:
        ll = self.ll
        n = len(tokens)
        batch = ll.llama_batch_init(n, 0, 1)
        try:
            batch.n_tokens = n
            for i, t in enumerate(tokens):
                batch.token[i] = t
                batch.pos[i] = pos + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1 if (want_logits and i == n - 1) else 0
            rc = ll.llama_decode(self.ctx, batch)
        finally:
            ll.llama_batch_free(batch)
        if self.hook is not None:
            self.hook.raise_pending()
        if self.prefetcher is not None:
            self.prefetcher.check_unchanged()
        if rc != 0:
            raise BadInput(f"llama.cpp failed to decode (status {rc})", self.path)

    def _last_logits(self) -> np.ndarray:
        ptr = self.ll.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        zero = PrefetchStats()
        stats = self.prefetcher.stats if self.prefetcher else zero
        batch = cfg["batch"]
        c0, s0, t0 = counters(), PrefetchStats(**vars(stats)), perf_counter_ns()
        for start in range(0, len(self.tokens), batch):
            chunk = self.tokens[start : start + batch]
            self._decode(chunk, start, start + len(chunk) == len(self.tokens))
        c1, s1, t1 = counters(), PrefetchStats(**vars(stats)), perf_counter_ns()
        logits = self._last_logits()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        generated: list[int] = []
        pos = len(self.tokens)
        for _ in range(cfg["n_predict"]):
            if cfg["logits_out"]:
                self.logits.append(logits)
            token = int(np.argmax(logits))
            if self.ll.llama_vocab_is_eog(self.vocab, token):
                break
            generated.append(token)
            piece = decoder.decode(_piece(self.ll, self.vocab, token))
            if piece:
                self.events.send(piece=piece)
            self._decode([token], pos, True)
            pos += 1
            logits = self._last_logits()
        tail = decoder.decode(b"", final=True)
        if tail:
            self.events.send(piece=tail)
        c2, s2, t2 = counters(), PrefetchStats(**vars(stats)), perf_counter_ns()
        if cfg["logits_out"]:
            self.logits.append(logits)
            np.save(cfg["logits_out"], np.stack(self.logits).astype(np.float32))
        if cfg["trace"]:
            np.save(cfg["trace"], _routing_array(self.routing))
        return {
            "prompt_tokens": len(self.tokens),
            "generated_tokens": len(generated),
            "generated": generated,
            "threads": cfg["threads"],
            "engine": self.prefetcher.choice.engine if self.prefetcher else None,
            "queue_depth": self.prefetcher.choice.queue_depth if self.prefetcher else None,
            "no_readaround_bytes": self.readaround_bytes,
            "prefill": {
                "tokens": len(self.tokens),
                "seconds": (t1 - t0) / 1e9,
                "counters": _delta(c1, c0),
                "prefetch": _stats_delta(s1, s0),
            },
            "decode": {
                "tokens": len(generated),
                "seconds": (t2 - t1) / 1e9,
                "counters": _delta(c2, c1),
                "prefetch": _stats_delta(s2, s1),
            },
        }

    def close(self) -> None:
        ll = self.ll
        if getattr(self, "threadpool", None):
            self.threadpool.close()
        if getattr(self, "ctx", None):
            ll.llama_free(self.ctx)
        if getattr(self, "model", None):
            ll.llama_model_free(self.model)
        if self.prefetcher is not None:
            self.prefetcher.close()


def _routing_array(routing: list[tuple[int, np.ndarray]]) -> np.ndarray:
    """Routing as records ``[layer, row, k ids…]`` in callback order (the parent makes the
    trace)."""
    if not routing:
        return np.zeros((0, 2), dtype=np.int32)
    k = max(ids.shape[1] for _, ids in routing)
    rows = []
    for layer, ids in routing:
        rec = np.full((ids.shape[0], k + 2), -1, dtype=np.int32)
        rec[:, 0] = layer
        rec[:, 1] = np.arange(ids.shape[0])
        rec[:, 2 : 2 + ids.shape[1]] = ids
        rows.append(rec)
    return np.concatenate(rows)


def _shards_of(path: str) -> list[Path]:
    from ..checkpoint.model import find_shards

    return find_shards(Path(path))


def main(argv: list[str]) -> int:
    cfg_path, fd = argv
    events = Events(os.fdopen(int(fd), "w", buffering=1))
    cfg = json.loads(Path(cfg_path).read_text())
    gen: Generation | None = None
    try:
        gen = Generation(cfg, events)
        events.send(result=gen.run())
        return 0
    except BadInput as e:
        events.send(error=e.message, path=e.path)
        return 3
    finally:
        if gen is not None:
            gen.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
