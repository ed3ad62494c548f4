"""llama.cpp as the judge of "drop-in": run the same tokens through two GGUFs and compare.

A repack only relabels experts, so llama.cpp must pick the same real experts and produce the
same logits, up to the order in which its router softmax sums (exact equality is not promised
for permuted F32 experts; ~1e-6 is typical). Each model runs in its own subprocess.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import Keys

from ...errors import BadInput
from ..protocol.child import run_worker, scratch_folder


@dataclass
class JudgeResult:
    original: Path
    candidate: Path
    tokens: int
    vocab: int
    max_abs_diff: float
    argmax_agreement: float
    bit_identical: bool
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance and self.argmax_agreement == 1.0


def run_logits(model: str | os.PathLike[str], tokens: np.ndarray, threads: int = 2) -> np.ndarray:
    """Logits ``[len(tokens), vocab]`` of ``model`` in llama.cpp (a worker process)."""
    path = Path(model)
    if not path.is_file():
        raise BadInput("no such file", path)
    with scratch_folder("judge") as d:
        tok, out = d / "tokens.npy", d / "logits.npy"
        np.save(tok, np.asarray(tokens, dtype=np.int64))
        job = {"model": str(path), "tokens": str(tok), "out": str(out), "threads": threads}
        run_worker("moepack.llama.judge.judge_worker", job, folder=d, model=path)
        return np.load(out)


def default_tokens(vocab: int, n: int = 24, seed: int = 0) -> np.ndarray:
    """A deterministic token run: BOS then ids drawn from the whole vocabulary."""
    rng = np.random.default_rng(seed)
    return np.concatenate([[1], rng.integers(3, vocab, size=n - 1)]).astype(np.int64)


def judge(
    original: str | os.PathLike[str],
    candidate: str | os.PathLike[str],
    tokens: np.ndarray | None = None,
    tolerance: float = 1e-5,
    threads: int = 2,
) -> JudgeResult:
    """Run both models on ``tokens`` and compare their logits token by token."""
    from ...checkpoint.model import MoeModel

    if tokens is None:
        with MoeModel(original) as m:
            vocab = len(m.shards[0].get(Keys.Tokenizer.LIST, []) or [])
        if vocab < 4:
            raise BadInput("model has no tokenizer vocabulary to draw tokens from", original)
        tokens = default_tokens(vocab)
    a = run_logits(original, tokens, threads)
    b = run_logits(candidate, tokens, threads)
    if a.shape != b.shape:
        raise BadInput(f"logit shapes differ: {a.shape} vs {b.shape}", candidate)
    return JudgeResult(
        original=Path(original),
        candidate=Path(candidate),
        tokens=len(tokens),
        vocab=a.shape[1],
        max_abs_diff=float(np.max(np.abs(a.astype(np.float64) - b))),
        argmax_agreement=float(np.mean(a.argmax(1) == b.argmax(1))),
        bit_identical=bool(np.array_equal(a, b)),
        tolerance=tolerance,
    )
