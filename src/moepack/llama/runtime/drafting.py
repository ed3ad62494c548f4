"""Drafting inside a llama.cpp worker: the drafters and the adaptive draft length.

A verification pass of ``1 + k`` tokens costs more than a one-token pass (more compute, and
under memory pressure the union of more tokens' experts) and yields ``1 + accepted`` tokens.
``AdaptiveLength`` measures both sides as the run goes — the acceptance per drafted token,
the seconds of a pass by its width, the seconds of drafting per token — and picks the ``k``
whose expected tokens per second is best, ``0`` (no draft) when none beats a one-token pass;
while off it probes a short draft now and then, so acceptance that comes back is seen, and
each probe that is rejected doubles the wait before the next (free text pays for fewer and
fewer wrong passes). A draft is at most twice as long as the run of drafts last accepted (plus
one; two to begin with): under memory pressure one long wrong draft reads the experts of many
unrelated tokens. The first one-token pass of a decode comes right after the prompt, its
experts read cold (several times a later pass): the second one-token pass timed replaces its
cost rather than averaging with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .draft import NGRAM, DraftOptions
from .session import LlamaSession, SessionParams

DECAY = 0.9
"""Weight of the past in the acceptance estimate, per verification pass."""
COST_EWMA = 0.25
"""Weight of a new pass in its width's cost estimate."""
MARGIN = 1.03
"""A draft length is chosen only when its expected rate beats no draft by this much."""
PROBE_EVERY = 16
"""Passes without a draft between probes of a short one (while off), to begin with."""
MAX_PROBE_EVERY = 256
"""The longest wait between probes, after rejected probes doubled it."""
PROBE_LENGTH = 2
REMEASURE_EVERY = 64
"""Passes with drafts between one-token passes that keep the one-token cost current."""
PRIOR_SLOPE = 0.15
"""Cost of each extra token of a pass against a one-token pass, until measured."""


class AdaptiveLength:
    """The draft length for the next pass, from what passes and drafts have cost so far.

    Acceptance is modelled per drafted token (the chance a draft is accepted when the one
    before it was): ``k`` drafts then yield ``(1 - a^(k+1)) / (1 - a)`` tokens a pass."""

    def __init__(self, max_length: int, adaptive: bool = True) -> None:
        self.max_length = max_length
        self.adaptive = adaptive
        self.hits = 1.0  # prior: one accepted and one rejected draft
        self.misses = 1.0
        self.cost: dict[int, float] = {}  # pass width -> seconds (EWMA)
        self.draft_cost = 0.0  # seconds of drafting per drafted token (EWMA)
        self.idle = 0  # passes since the last draft while off
        self.probe_every = PROBE_EVERY  # doubles with each rejected probe
        self.probing = False  # the draft asked for last was a probe
        self.singles = 0  # one-token passes timed (the second replaces the first's cost)
        self.busy = 0  # passes with drafts since the last one-token pass
        self.chosen: dict[int, int] = {}  # draft length -> passes it was chosen for
        # drafts grow by doubling what was last accepted: a long wrong draft under memory
        # pressure reads the union of many unrelated tokens' experts, most of the model
        self.ceiling = min(PROBE_LENGTH, max_length)

    def forget_acceptance(self) -> None:
        """Start acceptance afresh (a new request: other text); costs are kept."""
        self.hits, self.misses, self.idle = 1.0, 1.0, 0
        self.probe_every, self.probing = PROBE_EVERY, False
        self.ceiling = min(PROBE_LENGTH, self.max_length)

    @property
    def acceptance(self) -> float:
        return self.hits / (self.hits + self.misses)

    def length(self, remaining: int) -> int:
        """Tokens to draft for the next pass (at most ``remaining``)."""
        k = self.max_length if not self.adaptive else min(self._best(), self.ceiling)
        if self.adaptive:
            if k == 0:
                self.idle += 1
                if self.idle >= self.probe_every and 1 in self.cost:
                    self.idle = 0
                    k = min(PROBE_LENGTH, self.max_length)
                    self.probing = True
            else:
                self.busy += 1
                if self.busy > REMEASURE_EVERY:
                    k = 0
        k = max(0, min(k, remaining))
        self.chosen[k] = self.chosen.get(k, 0) + 1
        return k

    def _pass_cost(self, width: int) -> float:
        if width in self.cost:
            return self.cost[width]
        one = self.cost[1]
        slopes = [(c - one) / (w - 1) for w, c in self.cost.items() if w > 1]
        slope = max(0.0, float(np.mean(slopes))) if slopes else PRIOR_SLOPE * one
        return one + slope * (width - 1)

    def expected_rate(self, k: int) -> float:
        """Tokens per second expected of a pass with ``k`` drafts (needs a one-token cost)."""
        a = min(self.acceptance, 0.999)
        tokens = (1 - a ** (k + 1)) / (1 - a)
        return tokens / (self._pass_cost(k + 1) + k * self.draft_cost)

    def _best(self) -> int:
        if 1 not in self.cost:
            return 0  # a one-token pass first: what every draft is weighed against
        if len(self.cost) == 1:
            return self.max_length  # then a draft (as long as the ceiling): what it costs
        base = self.expected_rate(0) * MARGIN
        rates = [(self.expected_rate(k), k) for k in range(1, self.max_length + 1)]
        rate, k = max(rates)
        return k if rate > base else 0

    def observe_pass(self, width: int, seconds: float) -> None:
        if width == 1:
            self.busy = 0
            self.singles += 1
        old = self.cost.get(width)
        if width == 1 and self.singles == 2:
            old = None  # the first came right after the prompt, read cold
        self.cost[width] = seconds if old is None else old + COST_EWMA * (seconds - old)

    def observe_draft(self, drafted: int, accepted: int, seconds: float) -> None:
        """A verification of ``drafted`` tokens accepted the first ``accepted``; drafting
        them took ``seconds``."""
        if drafted <= 0:
            return
        self.hits = DECAY * self.hits + accepted
        self.misses = DECAY * self.misses + (1 if accepted < drafted else 0)
        self.ceiling = max(
            min(PROBE_LENGTH, self.max_length), min(self.max_length, 2 * (accepted + 1))
        )
        per = seconds / drafted
        self.draft_cost = (
            per if not self.draft_cost else self.draft_cost + COST_EWMA * (per - self.draft_cost)
        )
        self.idle = 0
        if self.probing:
            self.probing = False
            rejected = accepted == 0
            self.probe_every = (
                min(MAX_PROBE_EVERY, 2 * self.probe_every) if rejected else PROBE_EVERY
            )


class PromptLookup:
    """llama-cpp-python's own drafter: the tokens that followed the last n-gram (2, else 1)
    where it occurred before in the context (``LlamaPromptLookupDecoding``)."""

    kind = "prompt-lookup"

    def __init__(self, ngram: int = NGRAM) -> None:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self._find = LlamaPromptLookupDecoding.find_candidate_pred_tokens
        self.ngram = ngram

    def draft(self, context: Sequence[int], n: int) -> list[int]:
        ids = np.asarray(context, dtype=np.intc)
        return [int(t) for t in self._find(ids, self.ngram, n)][:n]

    def reset(self) -> None:
        return None

    def close(self) -> None:
        return None


class ModelDrafter:
    """A small model of the same vocabulary, decoding greedily ahead in a context of its own
    (llama.cpp, no prefetcher); its KV cache keeps the longest prefix it shares with the
    context it is asked about, so each draft costs only the tokens new since the last."""

    kind = "model"

    def __init__(self, path: str, params: SessionParams) -> None:
        self.session = LlamaSession(path, params)
        self.seq: list[int] = []  # the tokens in its KV cache, in order

    def reset(self) -> None:
        self.session.clear()
        self.seq = []

    def draft(self, context: Sequence[int], n: int) -> list[int]:
        s = self.session
        if n <= 0 or not context:
            return []
        room = s.n_ctx - len(context)
        n = min(n, room)
        if n <= 0:
            return []
        keep = _common_prefix(self.seq, context)
        keep = min(keep, len(context) - 1)  # the last token is fed again: its logits
        s.forget_from(keep)
        self.seq = list(context[:keep])
        logits = np.zeros(0, dtype=np.float32)
        batch = s.params.n_batch
        for start in range(keep, len(context), batch):
            chunk = list(context[start : start + batch])
            logits = s.decode(chunk, start, all_logits=False)
            self.seq.extend(chunk)
        out: list[int] = []
        while True:
            token = int(np.argmax(logits))
            if s.is_end(token):
                break
            out.append(token)
            if len(out) == n:
                break
            logits = s.decode([token], len(self.seq), all_logits=False)
            self.seq.append(token)
        return out

    def close(self) -> None:
        self.session.close()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class DraftRecord:
    """What drafting did in one phase: verification passes, drafted and accepted tokens,
    the experts those passes chose (distinct per layer, summed) against rows x top-k, and
    the one-token passes beside them."""

    verify_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_seconds: float = 0.0
    draft_seconds: float = 0.0
    single_passes: int = 0
    single_seconds: float = 0.0
    verify_union_experts: int = 0
    verify_routed: int = 0
    single_union_experts: int = 0
    single_routed: int = 0
    lengths: dict[int, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


def make_drafter(options: DraftOptions, params: SessionParams) -> PromptLookup | ModelDrafter:
    """The drafter ``options`` name (in the worker, llama-cpp-python loaded)."""
    if options.kind == "prompt-lookup":
        return PromptLookup()
    assert options.kind == "model" and options.model is not None
    return ModelDrafter(options.model, params)
