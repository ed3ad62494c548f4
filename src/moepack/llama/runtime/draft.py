"""What to draft with: the ``--draft`` / ``--draft-model`` choice, checked in the parent.

Drafted tokens are verified in one batch: llama.cpp computes the pass's tokens together, so
a layer reads the union of their chosen experts once (consecutive tokens share many), and
where the disk is the limit a pass that accepts several tokens pays for fewer bytes per
token. Greedy verification keeps the output the model's own: a draft is accepted only where
it is the token the model would have chosen.

Kinds: ``prompt-lookup`` (llama-cpp-python's ``LlamaPromptLookupDecoding``: the tokens that
followed the last n-gram's earlier occurrence in the context), ``model`` (a small GGUF with
the same vocabulary decodes greedily ahead), ``mtp`` (refused: see ``MTP_UNREACHABLE``) and
``off``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ...checkpoint.gguf_file import GgufFile
from ...errors import BadInput

KINDS = ("off", "prompt-lookup", "model")
DEFAULT_LENGTH = 10
"""Tokens drafted at most per pass (llama-cpp-python's own ``num_pred_tokens``)."""
MAX_LENGTH = 64
NGRAM = 2
"""The longest n-gram prompt lookup matches (llama-cpp-python's ``max_ngram_size``)."""
LOGIT_BOUND = 0.01
"""How far a verification pass's logits may differ from one-by-one decoding's, as a share of
the row's largest logit: llama.cpp computes a pass of several tokens with other kernels and
summation orders than a one-token pass (batch-size reassociation). Measured on the synthetic
families: none on six, 0.6 % on mixtral (tests/llama/test_draft.py holds every family to
this bound); greedy tokens can differ only where the best two logits are closer than twice
that, and on every family the tokens were the same."""

MTP_UNREACHABLE = (
    "llama-cpp-python cannot run MTP drafts: it binds load_mtp and LLAMA_CONTEXT_TYPE_MTP, but "
    "not llama.cpp's staging calls that carry the target's hidden state into the MTP context "
    "(llama_set_embeddings_nextn, llama_get_embeddings_nextn_ith, C++ names of its staging header), "
    "and its Llama never makes one"
)


@dataclass(frozen=True)
class DraftOptions:
    """``kind`` (``KINDS``), ``length``: tokens drafted at most per pass; ``model``: the
    draft GGUF of kind ``model``; ``adaptive``: the length follows the measured acceptance
    and the measured cost of a verification pass against a one-token pass, down to none."""

    kind: str = "off"
    length: int = DEFAULT_LENGTH
    model: str | None = None
    adaptive: bool = True

    @property
    def enabled(self) -> bool:
        return self.kind != "off"

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise BadInput(f"`draft` is one of {', '.join(KINDS)}, not {self.kind!r}")
        if not 1 <= self.length <= MAX_LENGTH:
            raise BadInput(f"a draft is 1 to {MAX_LENGTH} tokens, not {self.length}")
        if (self.kind == "model") != (self.model is not None):
            raise BadInput("a draft model is given exactly when `draft` is model")


def parse_draft(spec: str, model: str | os.PathLike[str] | None = None) -> DraftOptions:
    """``off``, ``prompt-lookup[:N]``, ``mtp`` (refused here: ``MTP_UNREACHABLE``), or —
    with ``model`` (``--draft-model``) — ``model[:N]`` or nothing more than a length."""
    name, _, count = spec.partition(":")
    name = name.strip()
    if name == "mtp":
        raise BadInput(MTP_UNREACHABLE)
    length = DEFAULT_LENGTH
    if count:
        try:
            length = int(count)
        except ValueError:
            raise BadInput(f"a draft length is a number, not {count!r}") from None
    if model is not None:
        if name not in ("off", "model", ""):
            raise BadInput(f"`draft` {spec} and a draft model are two drafters: give one")
        name = "model"
    options = DraftOptions(name, length, str(model) if model is not None else None)
    options.validate()
    return options


def check_draft_model(draft: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """``BadInput`` unless ``draft`` is a GGUF whose vocabulary is ``target``'s, token for
    token (a draft is verified by id: another vocabulary's ids mean other text)."""
    path = Path(draft)
    if not path.is_file():
        raise BadInput("no such file" if not path.exists() else "not a regular file", path)
    ours, theirs = _vocabulary(target), _vocabulary(path)
    if theirs is None:
        raise BadInput("the draft model has no tokenizer vocabulary", path)
    if ours is not None and ours != theirs:
        n, m = len(ours), len(theirs)
        why = (
            f"its vocabulary has {m} tokens, the model's {n}"
            if n != m
            else f"its vocabulary differs from the model's at token {_first_difference(ours, theirs)}"
        )
        raise BadInput(f"not a draft for this model: {why}", path)


def _vocabulary(path: str | os.PathLike[str]) -> list[str] | None:
    f = GgufFile(path)  # BadInput naming the file when it is not a GGUF
    try:
        tokens = f.get("tokenizer.ggml.tokens")
    finally:
        f.close()
    return None if tokens is None else [str(t) for t in tokens]


def _first_difference(a: list[str], b: list[str]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
