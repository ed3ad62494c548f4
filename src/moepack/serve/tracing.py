"""The routing of every request the server runs, spooled to disk as it is computed (worker
side; ``server`` writes the trace from the spool when the server stops).

The hook hands over each MoE layer's top-k as llama.cpp computes it; after every ``eval``
call (a prompt, or one sampled token) those become one ``[tokens, layers, k]`` block appended
to the spool (``llama.spool``), so memory does not grow with the requests served. A
generation that routed tokens becomes one prompt segment ``{prompt, start, prefill,
decode}``, sent to the parent as a ``segment`` event once its last block is on disk: a
parent that is stopped at once still has whole segments to write.

The cap (``trace_max_bytes``) bounds the spool: the first block that would pass it ends the
tracing, with one warning naming the cap; the generation it belonged to has no segment (its
tokens stay out of the trace). A worker started again after one died takes the spool over
(``resume``: the tokens and segments the parent has), cutting off what the dead one wrote
past them. Text is never kept unless asked (``text``): then each
request's prompt as llama.cpp was given it and the text generated after it go to
``texts.jsonl`` beside the spool, counted against the same cap.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from ..llama.protocol.spool import SpoolFiles

TEXTS = "texts.jsonl"


class TraceSpool:
    """Routing per ``eval`` call into ``folder``, and one segment per generation."""

    def __init__(
        self,
        files: ExitStack,
        folder: Path,
        blocks: list[int],
        k: int,
        id_dtype: str,
        max_bytes: int,
        send: Callable[..., None],
        warn: Callable[[str], None],
        text: bool = False,
        resume: dict[str, int] | None = None,
    ) -> None:
        self.blocks = list(blocks)
        self.k = k
        self.dtype = np.dtype(id_dtype)
        self.max_bytes = max_bytes
        self._send = send
        self._warn = warn
        self.tokens = 0  # tokens in the spool
        self.segments = 0
        if resume is not None:  # a worker that died left these (the parent has their segments)
            self.tokens, self.segments = int(resume["tokens"]), int(resume["segments"])
        self.bytes = self.tokens * self.token_bytes  # spool and text bytes so far
        kept = None if resume is None else {"ids": self.bytes}
        self.files = SpoolFiles(files, folder, ("ids",), resume=kept)
        self._texts: TextIO | None = None
        if text:
            lines = _texts_before(folder / TEXTS, self.segments) if resume is not None else []
            with ExitStack() as one:
                self._texts = one.enter_context(open(folder / TEXTS, "w", encoding="utf-8"))
                files.push(one.pop_all())
            self._texts.writelines(lines)
            self._texts.flush()
            self.bytes += sum(len(line.encode("utf-8")) for line in lines)
        self.full = False
        self._parts: dict[int, list[np.ndarray]] = {b: [] for b in self.blocks}
        self._segment: dict[str, int] | None = None
        self._prompt: list[int] = []

    @property
    def token_bytes(self) -> int:
        """Spool bytes of one token's routing."""
        return len(self.blocks) * self.k * self.dtype.itemsize

    def on_route(self, block: int, ids: np.ndarray) -> None:
        """A MoE layer's top-k ``[tokens, k]`` (called inside llama.cpp's compute)."""
        parts = self._parts.get(block)
        if parts is not None and not self.full:
            parts.append(np.asarray(ids).reshape(-1, self.k))

    def begin(self, prompt: list[int]) -> None:
        """A generation starts after ``prompt`` (its tokens as the server tokenized them)."""
        self._segment = {"prompt": self.segments, "start": self.tokens, "prefill": 0, "decode": 0}
        self._prompt = list(prompt)

    def after_eval(self, tokens: int, phase: str) -> None:
        """The routing of the ``eval`` call that fed ``tokens`` tokens, as ``phase``."""
        parts = self._parts
        self._parts = {b: [] for b in self.blocks}
        if self.full or self._segment is None or tokens == 0:
            return
        got = {b: sum(x.shape[0] for x in ps) for b, ps in parts.items()}
        if any(n != tokens for n in got.values()):
            self.discard()
            self._warn(
                f"the routing of {tokens} tokens came as {sorted(set(got.values()))} rows per "
                "layer: those tokens are left out of the trace"
            )
            return
        block = np.stack([np.concatenate(parts[b]) for b in self.blocks], axis=1)
        size = block.shape[0] * self.token_bytes
        if self.bytes + size > self.max_bytes:
            self._stop()
            return
        self.files.append(ids=block.astype(self.dtype, copy=False))
        self.tokens += block.shape[0]
        self.bytes += size
        self._segment[phase] += block.shape[0]

    def discard(self) -> None:
        """Forget the routing of an ``eval`` call that did not complete."""
        for p in self._parts.values():
            p.clear()

    def end(self, generated: list[int], detokenize: Callable[[list[int]], str]) -> None:
        """The generation is over: its segment (if it routed anything) goes to the parent."""
        seg, self._segment = self._segment, None
        if seg is None or self.full or seg["prefill"] + seg["decode"] == 0:
            return
        if self._texts is not None:
            line = json.dumps(
                {
                    "request": seg["prompt"],
                    "prompt": detokenize(self._prompt),
                    "completion": detokenize(generated),
                }
            )
            size = len(line.encode("utf-8")) + 1
            if self.bytes + size > self.max_bytes:
                self._stop()
                return
            self._texts.write(line + "\n")
            self._texts.flush()
            self.bytes += size
        self.segments += 1
        # a prompt's prefix llama.cpp kept from the previous request is not computed again:
        # ``reused`` of its tokens route nothing here
        reused = max(0, len(self._prompt) - seg["prefill"])
        self._send("segment", reused=reused, prompt_tokens=len(self._prompt), **seg)

    def _stop(self) -> None:
        self.full = True
        self._segment = None
        self.discard()
        self._warn(
            f"the trace reached `trace_max_bytes` ({self.max_bytes:,} bytes) after "
            f"{self.segments} requests: later requests are not traced"
        )

    def summary(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "bytes": self.bytes,
            "requests": self.segments,
            "full": self.full,
        }


def _texts_before(path: Path, segments: int) -> list[str]:
    """The text lines of the first ``segments`` requests (a worker that died may have written
    the line of a request whose segment it never sent)."""
    kept: list[str] = []
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                try:
                    if line.endswith("\n") and int(json.loads(line)["request"]) < segments:
                        kept.append(line)
                except (ValueError, KeyError, TypeError):
                    continue
    except OSError:
        return kept
    return kept
