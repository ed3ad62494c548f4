"""Prompts for a model with planted routing: token streams that stay on a topic with
probability ``stay`` and otherwise move to another topic, drawn with the plan's Zipf weights.
Text is the word pieces joined by spaces, which llama.cpp's SPM tokenizer turns back into
exactly these ids (each piece is "▁" + one character)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checkpoint.model import MoeModel
from ..checkpoint.routing import CJK_BASE, FIRST_WORD, RoutingPlan
from ..errors import BadInput
from ..filekinds import PROMPTS, check_output_kind
from ..keys import SYNTH_ROUTING
from ..safeio import check_destination, write_bytes_atomic


@dataclass(frozen=True)
class RoutingPrompt:
    tokens: list[int]  # without BOS
    topics: list[int]

    @property
    def text(self) -> str:
        return " ".join(chr(CJK_BASE + t - FIRST_WORD) for t in self.tokens)

    def to_json(self) -> dict[str, object]:
        return {"prompt": self.text, "tokens": self.tokens, "topics": self.topics}


def load_routing_plan(model: str | os.PathLike[str]) -> tuple[RoutingPlan, int]:
    """The planted routing recorded in ``model`` and its vocabulary size."""
    with MoeModel(model) as m:
        raw = m.shards[0].get(SYNTH_ROUTING)
        vocab = len(m.shards[0].get("tokenizer.ggml.tokens", []) or [])
    if not isinstance(raw, str):
        raise BadInput("model has no planted routing (synthesise it with `routing`)", model)
    return RoutingPlan.from_json(json.loads(raw)), vocab


def topic_chain(plan: RoutingPlan, tokens: int, rng: np.random.Generator) -> np.ndarray:
    """Topics of ``tokens`` consecutive tokens: keep with ``stay``, else a different topic."""
    p = plan.popularity
    out = np.empty(tokens, dtype=np.int64)
    out[0] = rng.choice(plan.topics, p=p)
    stays = rng.random(tokens) < plan.spec.stay
    for i in range(1, tokens):
        if stays[i]:
            out[i] = out[i - 1]
            continue
        q = p.copy()
        q[out[i - 1]] = 0.0
        out[i] = rng.choice(plan.topics, p=q / q.sum())
    return out


def routing_prompts(
    plan: RoutingPlan, vocab: int, prompts: int = 16, tokens: int = 128, seed: int = 0
) -> list[RoutingPrompt]:
    """``prompts`` streams of ``tokens`` word tokens each (BOS is the runtime's to add)."""
    if prompts < 1 or tokens < 1:
        raise BadInput("prompts and tokens per prompt must be >= 1")
    words = np.arange(FIRST_WORD, vocab)
    by_topic = [words[words % plan.topics == z] for z in range(plan.topics)]
    if any(len(w) == 0 for w in by_topic):
        raise BadInput(f"vocab {vocab} has too few words for {plan.topics} topics")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(prompts):
        topics = topic_chain(plan, tokens, rng)
        ids = [int(rng.choice(by_topic[z])) for z in topics]
        out.append(RoutingPrompt(ids, [int(z) for z in topics]))
    return out


def prompt_file_bytes(prompts: list[RoutingPrompt], jsonl: bool) -> bytes:
    """One prompt per line: JSONL (``prompt``, ``tokens``, ``topics``) or the text alone."""
    if jsonl:
        body = "".join(json.dumps(p.to_json(), ensure_ascii=False) + "\n" for p in prompts)
    else:
        body = "".join(p.text + "\n" for p in prompts)
    return body.encode("utf-8")


def write_prompts(path: str | os.PathLike[str], prompts: list[RoutingPrompt]) -> Path:
    """Write ``prompts`` to ``path`` (JSONL when it ends in ``.jsonl``), atomically."""
    dest = check_destination(check_output_kind(path, PROMPTS), ())
    return write_bytes_atomic(dest, prompt_file_bytes(prompts, dest.suffix == ".jsonl"))
