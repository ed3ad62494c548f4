"""The memory a run takes, counted before it loads: what ``--memory`` (or the memory
available) has to hold, and what is left of it for the routed experts.

A run holds its dense weights (locked, or repacked by llama.cpp), the KV cache and recurrent
state at the context asked for, llama.cpp's compute buffers, the server's prefix cache, and
the worker itself (Python, numpy, llama.cpp's libraries: ``RUNTIME_BYTES``); the experts get
the rest. llama.cpp says what its context takes (``memory_probe``: a simulated allocation of
the real shape, nothing loaded), so every family's cache is counted as llama.cpp counts it.
A plan whose experts would get less than the streamer needs is refused before anything
loads, in one line naming the shortfall and the context that would fit.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ...checkpoint.model import MoeModel
from ...errors import BadInput
from ...storage.linux import mem_available
from ..prefetcher.pinning import dense_ranges
from ..prefetcher.streamer import MARGIN
from ..protocol.child import run_worker, scratch_folder

GIB = 1 << 30
MIB = 1 << 20
RUNTIME_BYTES = 192 * MIB
"""The run's own memory beside the weights and the context: two interpreters (the command
and its llama.cpp worker), numpy, llama.cpp's libraries, the tokenizer's tables, thread
stacks (measured: 124 MiB resident in both processes together, 71 MiB of it anonymous, on a
7 MB model whose weights and context take a few MiB)."""
CTX_STEP = 256
"""Contexts suggested are multiples of this."""


@dataclass(frozen=True)
class ContextNeeds:
    """What one context shape takes, as llama.cpp counts it."""

    n_ctx: int
    state_bytes: int  # KV cache and recurrent state
    compute_bytes: int

    @property
    def bytes(self) -> int:
        return self.state_bytes + self.compute_bytes


def context_needs(
    model: str | os.PathLike[str],
    n_ctx: list[int],
    n_batch: int = 512,
    n_ubatch: int | None = None,
    kv_type: str = "f16",
) -> list[ContextNeeds]:
    """llama.cpp's KV/recurrent state and compute buffer bytes for each context length, from
    a simulated allocation in a worker (llama.cpp aborts on some bad models)."""
    path = Path(model)
    shapes = [
        {
            "n_ctx": n,
            "n_batch": n_batch,
            "n_ubatch": n_ubatch or n_batch,
            "kv_type": {"f32": 0, "f16": 1}[kv_type],
        }
        for n in n_ctx
    ]
    with scratch_folder("memory") as folder:
        outcome = run_worker(
            "moepack.llama.runtime.memory_probe",
            {"model": str(path), "shapes": shapes},
            folder=folder,
            model=path,
        )
    return [
        ContextNeeds(int(s["n_ctx"]), int(s["state_bytes"]), int(s["compute_bytes"]))
        for s in outcome.done["sizes"]
    ]


@dataclass(frozen=True)
class MemoryPlan:
    """Where the memory of one run goes (bytes)."""

    total: int  # --memory, or the memory available less the margin
    asked: bool  # total is --memory, not the memory available
    file_bytes: int
    dense: int  # every byte of the file but the routed experts
    context: ContextNeeds
    prefix_cache: int
    runtime: int = RUNTIME_BYTES

    @property
    def reserve(self) -> int:
        """Everything but the weights."""
        return self.context.bytes + self.prefix_cache + self.runtime

    @property
    def experts(self) -> int:
        """What is left for the routed experts when they stream."""
        return self.total - self.dense - self.reserve

    @property
    def fits(self) -> bool:
        """Whether the whole file and the context fit (llama.cpp can keep everything)."""
        return self.file_bytes + self.reserve <= self.total

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["context"] = asdict(self.context)
        out.update(reserve=self.reserve, experts=self.experts, fits=self.fits)
        return out


def plan_memory(
    model: str | os.PathLike[str],
    memory: int | str = "auto",
    *,
    n_ctx: int,
    n_batch: int = 512,
    n_ubatch: int | None = None,
    prefix_cache: int = 0,
    available: int | None = None,
) -> MemoryPlan:
    """The plan of a run on ``model`` with ``memory`` (a byte count, or ``auto``: the memory
    available less the margin the live cache leaves). llama.cpp is asked what the context
    takes unless a generous bound of it (``rough_context_bytes``) already fits with the whole
    file: a model far smaller than memory is not worth a worker's start."""
    with MoeModel(model) as m:
        size = m.file_bytes
        dense = sum(r.length for r in dense_ranges(m))
        rough = rough_context_bytes(m, n_ctx, min(n_ubatch or n_batch, n_batch))
    if isinstance(memory, int):
        total, asked = memory, True
    else:
        free = mem_available() if available is None else available
        total, asked = free - max(MARGIN, free // 20), False
    if size + rough + prefix_cache + RUNTIME_BYTES <= total:
        needs = ContextNeeds(n_ctx, rough, 0)  # an upper bound: everything fits anyway
    else:
        needs = context_needs(model, [n_ctx], n_batch, n_ubatch)[0]
    return MemoryPlan(total, asked, size, dense, needs, prefix_cache)


def memory_for_experts(
    model: str | os.PathLike[str],
    experts: int,
    *,
    n_ctx: int,
    n_batch: int = 512,
    n_ubatch: int | None = None,
    prefix_cache: int = 0,
) -> int:
    """The ``memory`` a run needs for its experts to get ``experts`` bytes: the plan's
    arithmetic the other way round."""
    (needs,) = context_needs(model, [n_ctx], n_batch, n_ubatch)
    with MoeModel(model) as m:
        dense = sum(r.length for r in dense_ranges(m))
    return dense + needs.bytes + prefix_cache + RUNTIME_BYTES + experts


def rough_context_bytes(model: MoeModel, n_ctx: int, n_ubatch: int) -> int:
    """More than any context of ``n_ctx`` tokens takes on ``model``: an F32 KV cache as wide
    as the embedding in every block, and compute buffers holding a full attention score
    matrix per head besides the logits and a few dozen activations of every token."""
    first = model.shards[0]
    arch = model.architecture
    emb = model.tensors.get("token_embd.weight")
    n_embd = int(emb.ne[0]) if emb is not None else 8192
    n_vocab = int(emb.ne[1]) if emb is not None and len(emb.ne) > 1 else 262144
    heads = first.get_int(f"{arch}.attention.head_count", 64, allow_list=True)
    n_head = max(heads) if isinstance(heads, list) and heads else int(heads or 64)
    blocks = max(1, model.block_count)
    kv = blocks * n_ctx * 2 * n_embd * 4
    compute = n_ubatch * (n_ctx * max(n_head, 1) + n_vocab + 64 * n_embd) * 4
    return kv + 2 * compute


def check_streaming_plan(
    plan: MemoryPlan,
    least_experts: int,
    model: str | os.PathLike[str],
    n_batch: int = 512,
    why_least: str = "",
) -> None:
    """``BadInput`` in one line when the experts would get less than ``least_experts`` (what
    the streamer needs to make progress, ``why_least`` saying whose minimum): the shortfall,
    and the context that would fit."""
    if plan.experts >= least_experts:
        return
    where = "`memory`" if plan.asked else "the memory available"
    fixed = plan.dense + plan.prefix_cache + plan.runtime + least_experts
    room = plan.total - fixed
    ctx = plan.context
    text = (
        f"needs {_size(ctx.bytes)} for a context of {ctx.n_ctx} tokens (KV "
        f"{_size(ctx.state_bytes)}, compute {_size(ctx.compute_bytes)}), {_size(plan.dense)} "
        "of dense weights, "
        + (f"a {_size(plan.prefix_cache)} prefix cache, " if plan.prefix_cache else "")
        + f"{_size(plan.runtime)} for the run itself and {least_experts:,} bytes for the "
        f"experts{f' ({why_least})' if why_least else ''}; {where} is {plan.total:,} bytes"
    )
    fit = _fitting_context(model, ctx, room, n_batch) if room > 0 else None
    if fit is not None:
        text += f": `n_ctx` {fit} fits"
    else:
        least_ctx = ctx if ctx.n_ctx <= CTX_STEP else context_needs(model, [CTX_STEP], n_batch)[0]
        text += (
            f": give at least {fixed + least_ctx.bytes:,} bytes for a context of "
            f"{least_ctx.n_ctx} tokens"
        )
    # the prefix cache is the one term a user sizes freely: say what of it fits, if any
    cache_room = room + plan.prefix_cache - ctx.bytes
    if plan.prefix_cache and MIB <= cache_room < plan.prefix_cache:
        text += f", or `prefix_cache` {cache_room // MIB}M at this context"
    raise BadInput(text, model)


def _fitting_context(
    model: str | os.PathLike[str], asked: ContextNeeds, room: int, n_batch: int
) -> int | None:
    """The longest context (a multiple of ``CTX_STEP``) whose needs fit in ``room`` bytes, by
    llama.cpp's own counts at two lengths (its needs grow linearly with the context), then
    checked at the length found."""
    if asked.n_ctx <= CTX_STEP:
        return None
    low = context_needs(model, [CTX_STEP], n_batch)[0]
    per_token = max(0.0, (asked.bytes - low.bytes) / (asked.n_ctx - CTX_STEP))
    if low.bytes > room:
        return None
    n = asked.n_ctx if per_token == 0 else CTX_STEP + int((room - low.bytes) / per_token)
    n = min(asked.n_ctx - CTX_STEP, n // CTX_STEP * CTX_STEP)
    for _ in range(8):  # the linear guess is close: a few steps down at most
        if n < CTX_STEP:
            return None
        if context_needs(model, [n], n_batch)[0].bytes <= room:
            return n
        n -= max(CTX_STEP, n // 8 // CTX_STEP * CTX_STEP)
    return None


def _size(n: int) -> str:
    if abs(n) >= GIB:
        return f"{n / GIB:.1f} GiB"
    return f"{n / MIB:.0f} MiB" if abs(n) >= MIB else f"{n / 1024:.0f} KiB"
