"""``check-dropin``: the evidence that a rewritten GGUF computes what the original did.

Four gates, each reported with its numbers; the verdict is PASS only when all four pass:

1. **bytes** — ``verify`` accounts for every byte of CANDIDATE against ORIGINAL;
2. **control** — two runs of ORIGINAL in two processes give bit-identical logits and routing,
   so any difference below is the rewrite's, not the engine's;
3. **routing** — CANDIDATE's expert ids, mapped back through the permutation it records, are
   ORIGINAL's on 100 % of (token, layer), as sets and in router order;
4. **output** — the mean KL divergence between the two files' next-token distributions over
   the text is at most the KL between two settings of the same engine on ORIGINAL (F32 vs
   F16 KV cache); perplexities of all three runs side by side.

Every llama.cpp run is a child process (``dropin_worker``) that spools logits and routing to
files in a temporary folder; the comparisons read them through memory maps in chunks.
"""

from __future__ import annotations

import inspect
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint.model import MoeModel
from ..checkpoint.provenance import read_provenance
from ..checkpoint.synth import llama_cpp_available
from ..errors import BadInput, MoepackError
from ..progress import NULL_PROGRESS, ProgressSink
from ..rewrite.verify import verify
from ..trace.core import id_dtype_for
from .capture import ModelFacts, model_facts

TEXT_MODULES = ("json", "argparse", "collections", "pathlib", "subprocess", "logging", "csv")
CHUNK_ROWS = 256


def default_text() -> str:
    """English prose every Python install carries: standard-library module documentation."""
    import importlib

    parts = []
    for name in TEXT_MODULES:
        mod = importlib.import_module(name)
        parts.append(inspect.getdoc(mod) or "")
        for _, obj in sorted(vars(mod).items()):
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__doc__:
                parts.append(inspect.getdoc(obj) or "")
    return "\n\n".join(p for p in parts if p)


@dataclass
class Gate:
    name: str
    ok: bool
    summary: str
    numbers: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"gate": self.name, "ok": self.ok, "summary": self.summary, **self.numbers}


@dataclass
class DropinResult:
    original: Path
    candidate: Path
    tokens: int
    gates: list[Gate]

    @property
    def ok(self) -> bool:
        return all(g.ok for g in self.gates)

    def to_json(self) -> dict[str, Any]:
        return {
            "original": str(self.original),
            "candidate": str(self.candidate),
            "tokens": self.tokens,
            "verdict": "PASS" if self.ok else "FAIL",
            "gates": [g.to_json() for g in self.gates],
        }


@dataclass
class DropinRun:
    """One child run's spooled outputs, memory-mapped."""

    tokens: np.ndarray
    ids: np.ndarray
    logits: np.ndarray
    windows: list[int]


def _run(
    model: Path, facts: ModelFacts, folder: Path, text: str, n_tokens: int, kv: str, opts: dict
) -> DropinRun:
    folder.mkdir()
    job = {
        "model": str(model),
        "out": str(folder),
        "blocks": facts.blocks,
        "k": facts.k,
        "id_dtype": id_dtype_for(facts.n_expert).name,
        "text": text,
        "n_tokens": n_tokens,
        "kv_type": kv,
        **opts,
    }
    job_path = folder / "job.json"
    job_path.write_text(json.dumps(job))
    proc = subprocess.run(
        [sys.executable, "-m", "moepack.llama.dropin_worker", str(job_path)],
        capture_output=True,
        text=True,
    )
    events = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    done = next((e for e in events if e.get("event") == "done"), None)
    if proc.returncode != 0 or done is None:
        err = next((e["message"] for e in events if e.get("event") == "error"), None)
        if err is None:
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            how = f"signal {-proc.returncode}" if proc.returncode < 0 else "an error"
            err = f"llama.cpp stopped with {how}" + (f": {lines[-1].strip()}" if lines else "")
        raise BadInput(err, model)
    n, vocab = int(done["tokens"]), int(done["vocab"])
    shape = (n, len(facts.blocks), facts.k)
    return DropinRun(
        tokens=np.fromfile(folder / "tokens.bin", dtype="<i4"),
        ids=np.memmap(
            folder / "ids.bin", dtype=id_dtype_for(facts.n_expert), mode="r", shape=shape
        ),
        logits=np.memmap(folder / "logits.bin", dtype="<f4", mode="r", shape=(n, vocab)),
        windows=list(done["windows"]),
    )


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def mean_kl(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over rows of KL(softmax(a) || softmax(b)), in bounded chunks."""
    total = 0.0
    for s in range(0, a.shape[0], CHUNK_ROWS):
        la, lb = (
            _log_softmax(np.asarray(a[s : s + CHUNK_ROWS])),
            _log_softmax(np.asarray(b[s : s + CHUNK_ROWS])),
        )
        total += float(np.sum(np.exp(la) * (la - lb)))
    return total / a.shape[0]


def perplexity(run: DropinRun) -> float:
    """exp(mean NLL of each window's next token), windows as the run cut them."""
    nll, count, start = 0.0, 0, 0
    for w in run.windows:
        logp = _log_softmax(np.asarray(run.logits[start : start + w - 1]))
        nxt = run.tokens[start + 1 : start + w]
        nll -= float(logp[np.arange(w - 1), nxt].sum())
        count += w - 1
        start += w
    return float(np.exp(nll / max(count, 1)))


def _bytes_gate(original: Path, candidate: Path, progress: ProgressSink) -> Gate:
    try:
        r = verify(original, candidate, progress=progress)
    except MoepackError as e:
        return Gate("bytes", False, f"verify failed: {e.message}")
    nums = {
        "bytes_compared": r.bytes_compared,
        "tensors_compared": r.tensors_compared,
        "tensors_permuted": r.tensors_permuted,
        "blocks_permuted": r.blocks_permuted,
    }
    if r.ok:
        return Gate("bytes", True, f"every byte accounted for ({r.bytes_compared:,})", nums)
    d = r.difference
    return Gate("bytes", False, f"differs: {d.message if d else 'unknown'}", nums)


def _routing_gate(a: DropinRun, b: DropinRun, facts: ModelFacts, candidate: Path) -> Gate:
    with MoeModel(candidate) as m:
        prov = read_provenance(m)
    if a.ids.shape != b.ids.shape:
        return Gate("routing", False, f"routing shapes differ: {a.ids.shape} vs {b.ids.shape}")
    ordered = sets = 0
    cells = a.ids.shape[0] * a.ids.shape[1]
    first_bad: tuple[int, int] | None = None
    for layer, block in enumerate(facts.blocks):
        perm = prov.perm(block, facts.n_expert) if prov is not None else np.arange(facts.n_expert)
        mapped = np.asarray(perm)[np.asarray(b.ids[:, layer], dtype=np.int64)]
        orig = np.asarray(a.ids[:, layer], dtype=np.int64)
        same_order = np.all(mapped == orig, axis=1)
        same_set = np.all(np.sort(mapped, axis=1) == np.sort(orig, axis=1), axis=1)
        ordered += int(same_order.sum())
        sets += int(same_set.sum())
        if first_bad is None and not same_set.all():
            first_bad = (int(np.flatnonzero(~same_set)[0]), block)
    nums = {
        "cells": cells,
        "same_set": sets / cells,
        "same_order": ordered / cells,
        "permutation": "recorded" if prov is not None else "identity (none recorded)",
    }
    ok = sets == cells and ordered == cells
    if ok:
        summary = f"100 % of {cells:,} (token, layer) map back, as sets and in order"
    else:
        where = f"; first at token {first_bad[0]}, block {first_bad[1]}" if first_bad else ""
        summary = (
            f"{100 * sets / cells:.2f} % as sets, {100 * ordered / cells:.2f} % in order{where}"
        )
    return Gate("routing", ok, summary, nums)


def check_dropin(
    original: str | Path,
    candidate: str | Path,
    *,
    n_tokens: int = 1024,
    text: str | None = None,
    window: int = 256,
    threads: int = 2,
    progress: ProgressSink = NULL_PROGRESS,
) -> DropinResult:
    """DropinRun the four gates on ORIGINAL and CANDIDATE (see the module docstring)."""
    if not llama_cpp_available():
        raise MoepackError("llama.cpp is not installed: pip install 'moepack[llama]'")
    orig, cand = Path(original), Path(candidate)
    if n_tokens < 2 or window < 2:
        raise BadInput("tokens and window must be >= 2")
    facts = model_facts(orig)
    cand_facts = model_facts(cand)
    if (cand_facts.blocks, cand_facts.n_expert, cand_facts.k) != (
        facts.blocks,
        facts.n_expert,
        facts.k,
    ):
        raise BadInput("not a rewrite of the original: MoE blocks or expert counts differ", cand)
    body = text if text is not None else default_text()
    gates = [_bytes_gate(orig, cand, progress)]
    opts = {"window": window, "threads": threads}
    tmp = Path(tempfile.mkdtemp(prefix="moepack-dropin-"))
    try:
        progress.start("llama.cpp runs", 4, unit="runs")
        runs = {}
        for name, model, kv in (
            ("a1", orig, "f32"),
            ("a2", orig, "f32"),
            ("b", cand, "f32"),
            ("a16", orig, "f16"),
        ):
            runs[name] = _run(model, facts, tmp / name, body, n_tokens, kv, opts)
            progress.advance(1)
        progress.finish()
        a1, a2, b, a16 = runs["a1"], runs["a2"], runs["b"], runs["a16"]
        if not np.array_equal(a1.tokens, b.tokens):
            raise BadInput("the candidate tokenizes the text differently", cand)
        same_logits = bool(np.array_equal(np.asarray(a1.logits), np.asarray(a2.logits)))
        same_ids = bool(np.array_equal(np.asarray(a1.ids), np.asarray(a2.ids)))
        max_diff = float(np.max(np.abs(np.asarray(a1.logits, np.float64) - np.asarray(a2.logits))))
        gates.append(
            Gate(
                "control",
                same_logits and same_ids,
                "two runs of ORIGINAL are bit-identical"
                if same_logits and same_ids
                else f"two runs of ORIGINAL differ (max |logit diff| {max_diff:.3g})",
                {"bit_identical": same_logits, "routing_identical": same_ids, "max_abs": max_diff},
            )
        )
        gates.append(_routing_gate(a1, b, facts, cand))
        kl = mean_kl(a1.logits, b.logits)
        envelope = mean_kl(a1.logits, a16.logits)
        ppl = {
            "original": perplexity(a1),
            "candidate": perplexity(b),
            "original_f16_kv": perplexity(a16),
        }
        gates.append(
            Gate(
                "output",
                kl <= envelope,
                f"mean KL {kl:.3g} vs F32/F16-KV envelope {envelope:.3g} over {a1.logits.shape[0]:,} tokens",
                {
                    "kl": kl,
                    "envelope_kl": envelope,
                    "perplexity": ppl,
                    "tokens": a1.logits.shape[0],
                },
            )
        )
        tokens = int(a1.logits.shape[0])
        del runs, a1, a2, b, a16
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return DropinResult(original=orig, candidate=cand, tokens=tokens, gates=gates)
