"""Drafts on a ``llama_cpp.Llama`` of the caller's own: ``drafting(llm, DraftOptions(...))``.

llama-cpp-python verifies drafts itself: ``Llama.generate`` asks its ``draft_model`` for
tokens after each sampled one, evaluates the token and the drafts in one ``eval`` (every
position's logits), samples position by position and stops at the first draft that differs,
dropping the rest from the KV cache. So the hook only supplies the drafts (llama-cpp-python's
own ``LlamaPromptLookupDecoding``, or a draft model), with the adaptive length of
``drafting.AdaptiveLength``: the instance's ``eval`` is wrapped to time each pass by its
width, and its ``generate`` to learn, per request, how many drafts were kept — at the next
draft (the tokens since are the ones sampled) or when the generation ends. Acceptance starts
afresh with each request; the costs of passes carry over (they are the machine's).

The ``Llama`` must compute every position's logits (``logits_all``, which llama-cpp-python
turns on itself for a draft model given to its constructor); a ``Llama`` made without it gets
it here, and with it the scores array that holds them.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from time import perf_counter_ns
from typing import Any

import numpy as np

from .draft import DraftOptions
from .drafting import AdaptiveLength, DraftRecord, ModelDrafter, PromptLookup, make_drafter
from .session import SessionParams

BatchCounts = Callable[[], tuple[int, int]]


class DraftHook:
    """Drafting attached to one ``Llama`` (``drafting`` makes it)."""

    def __init__(
        self, llm: Any, options: DraftOptions, *, batch_counts: BatchCounts | None = None
    ) -> None:
        options.validate()
        if not options.enabled:
            raise ValueError("drafting needs a drafter (kind prompt-lookup or model)")
        self.llm = llm
        self.options = options
        if not llm._logits_all:  # every position's logits: the drafts are sampled there
            llm._logits_all = True
            llm.scores = np.zeros((llm._n_ctx, llm._n_vocab), dtype=np.single)
        params = SessionParams(
            n_ctx=llm._n_ctx,
            n_batch=llm.n_batch,
            n_ubatch=llm.n_batch,
            threads=max(1, int(llm.context_params.n_threads)),
            kv_type="f16",
        )
        self.drafter: PromptLookup | ModelDrafter = make_drafter(options, params)
        self.lengths = AdaptiveLength(options.length, options.adaptive)
        self.record = DraftRecord()
        self.batch_counts = batch_counts
        self.on_rejected: Callable[[int], None] | None = None  # drafts computed, not kept
        self._pending: tuple[int, list[int], float] | None = None
        self._decoding = False
        self._eval = llm.eval
        self._generate = llm.generate
        llm.eval = self.eval
        llm.generate = self.generate
        llm.draft_model = self
        self.attached = True

    # -- llama-cpp-python calls these --------------------------------------------------------

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        """The drafts after ``input_ids`` (the tokens so far, the one just sampled last)."""
        seq = [int(t) for t in input_ids]
        self._resolve(seq)
        if not self.attached:
            return np.zeros(0, dtype=np.intc)
        k = self.lengths.length(max(0, self.llm._n_ctx - len(seq) - 1))
        t0 = perf_counter_ns()
        drafts = self.drafter.draft(seq, k) if k else []
        seconds = (perf_counter_ns() - t0) / 1e9
        self.record.draft_seconds += seconds
        self._pending = (len(seq), drafts, seconds) if drafts else None
        return np.asarray(drafts, dtype=np.intc)

    def eval(self, tokens: Sequence[int]) -> None:
        """``Llama.eval``, timed by width once the generation decodes."""
        if not self._decoding or not self.attached:
            self._eval(tokens)
            return
        u0 = self.batch_counts() if self.batch_counts else (0, 0)
        t0 = perf_counter_ns()
        self._eval(tokens)
        seconds = (perf_counter_ns() - t0) / 1e9
        u1 = self.batch_counts() if self.batch_counts else (0, 0)
        self.lengths.observe_pass(len(tokens), seconds)
        r = self.record
        if len(tokens) > 1:
            r.verify_passes += 1
            r.verify_seconds += seconds
            r.verify_union_experts += u1[0] - u0[0]
            r.verify_routed += u1[1] - u0[1]
        else:
            r.single_passes += 1
            r.single_seconds += seconds
            r.single_union_experts += u1[0] - u0[0]
            r.single_routed += u1[1] - u0[1]
        r.lengths[len(tokens) - 1] = r.lengths.get(len(tokens) - 1, 0) + 1

    def generate(
        self, tokens: Sequence[int], *args: Any, **kwargs: Any
    ) -> Generator[int, Sequence[int] | None, None]:
        """``Llama.generate``: a request. Acceptance is learnt afresh; what it emitted
        settles the last drafts."""
        if not self.attached:  # detached: llama-cpp-python's own, untouched
            yield from self._generate(tokens, *args, **kwargs)
            return
        seq = [int(t) for t in tokens]
        self._pending = None
        self.lengths.forget_acceptance()
        self.drafter.reset()
        inner = self._generate(tokens, *args, **kwargs)
        self._decoding = False
        try:
            sent: Sequence[int] | None = None
            while True:
                try:
                    token = inner.send(sent) if sent is not None else next(inner)
                except StopIteration:
                    return
                self._decoding = True  # every later eval is a decode pass
                seq.append(int(token))
                sent = yield token
        finally:
            inner.close()
            self._decoding = False
            self._resolve(seq)

    # -- the record --------------------------------------------------------------------------

    def _resolve(self, seq: list[int]) -> None:
        """How many of the last drafts ``seq`` (the tokens since sampled) kept."""
        if self._pending is None:
            return
        pos, drafts, seconds = self._pending
        self._pending = None
        got = seq[pos : pos + len(drafts)]
        kept = 0
        while kept < len(got) and got[kept] == drafts[kept]:
            kept += 1
        self.lengths.observe_draft(len(drafts), kept, seconds)
        self.record.drafted += len(drafts)
        self.record.accepted += kept
        if self.on_rejected is not None and kept < len(drafts):
            self.on_rejected(len(drafts) - kept)

    def snapshot(self) -> dict[str, Any]:
        """The record so far (``DraftRecord`` fields; ``lengths``: passes by drafts fed)."""
        return self.record.to_json()

    def detach(self) -> None:
        """No more drafts (the ``Llama`` decodes one token a pass again, its ``eval`` and
        ``generate`` wrappers passing straight through; idempotent)."""
        if not self.attached:
            return
        self.attached = False
        self.llm.draft_model = None
        self.drafter.close()


def drafting(
    llm: Any, options: DraftOptions, *, batch_counts: BatchCounts | None = None
) -> DraftHook:
    """Give ``llm`` (a ``llama_cpp.Llama``) drafts verified a pass at a time, their length
    adapting to the measured acceptance and cost. ``batch_counts``: the prefetcher's counts of
    distinct experts and rows x top-k (``ExpertStreamer.batch_counts``), for the record of
    what a verification batch read."""
    return DraftHook(llm, options, batch_counts=batch_counts)
