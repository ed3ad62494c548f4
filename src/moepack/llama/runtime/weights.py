"""Where a loaded model's weights really are: in the file's mapping, or copied out of it.

llama.cpp exposes no per-tensor buffer, but its graph does: every matrix multiplication's
first source is a weight, with its data pointer and its buffer. ``probe`` builds a throwaway
one-token context whose eval callback records them as the scheduler asks about each node,
and whose abort callback stops the computation at its first node, so nothing is computed
and no weight is read. A weight is *mapped* when its data lies inside llama.cpp's mapping of
one of the model's files (``/proc/self/maps``); *repacked* when its buffer is one of the CPU
backend's extra buffer types (``REPACKED_BUFTS``), which rewrite weights at load into their
kernels' layouts: ``CPU_REPACK``, and ``AMX`` in a build for a CPU with AMX (its tile layout,
taken before ``CPU_REPACK`` for the 2-D matrices of the types it has kernels for).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from ..prefetcher.evalcb import GgmlTensor, op_index
from ..prefetcher.mapping import file_mappings
from . import ggml_backend

REPACKED_BUFTS = (ggml_backend.REPACK_BUFT, "AMX", "CPU_KLEIDIAI", "CPU_RISCV64_SPACEMIT")
"""ggml's CPU extra buffer types: x86's repack, Intel AMX's, Arm KleidiAI's, SpacemiT's."""


@dataclass(frozen=True)
class WeightSite:
    """One weight as the graph uses it: its buffer's type and whether it is in the mapping."""

    buffer_type: str
    mapped: bool


def anon_bytes() -> int | None:
    """This process's anonymous resident memory (``RssAnon``), or None where unknown."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def probe(model: Any, paths: Sequence[str | os.PathLike[str]]) -> dict[str, WeightSite]:
    """Every weight a one-token graph of ``model`` (a ``llama_model *``) multiplies with, by
    name, with where it lies relative to the mappings of ``paths`` (the model's shards)."""
    import llama_cpp

    spans = [(s, e) for p in paths for s, e, _off in file_mappings(Path(p))]
    mul = {op_index("MUL_MAT"), op_index("MUL_MAT_ID")}
    seen: dict[str, WeightSite] = {}

    def on_node(ptr: int, ask: bool, _user: int) -> bool:
        try:
            t = GgmlTensor.from_address(ptr)
            if ask and t.op in mul and t.src[0]:
                w = GgmlTensor.from_address(t.src[0])
                while w.view_src:  # a view's data lies inside its source's
                    w = GgmlTensor.from_address(w.view_src)
                name = w.name.decode(errors="replace")
                if name not in seen:
                    data = int(w.data or 0)
                    inside = any(s <= data < e for s, e in spans)
                    seen[name] = WeightSite(ggml_backend.buffer_type_name(w.buffer), inside)
        except Exception:  # never across the C boundary; a node not read is a node not seen
            pass
        return False

    callback = llama_cpp.ggml_backend_sched_eval_callback(on_node)
    stop = llama_cpp.ggml_abort_callback(lambda _data: True)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = 256
    params.n_batch = params.n_ubatch = 1
    params.n_seq_max = 1
    params.n_threads = params.n_threads_batch = 1
    params.flash_attn_type = 0
    params.no_perf = True
    params.cb_eval = callback
    params.cb_eval_user_data = None
    params.abort_callback = stop
    params.abort_callback_data = None
    with llama_log_dropped(llama_cpp):  # the abort is logged as a failed decode
        ctx = llama_cpp.llama_init_from_model(model, params)
        if not ctx:
            raise RuntimeError("llama.cpp made no context to find where the weights are")
        try:
            token = (llama_cpp.llama_token * 1)(0)
            llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(token, 1))  # aborted
        finally:
            llama_cpp.llama_free(ctx)
    return seen


@contextmanager
def llama_log_dropped(llama_cpp: Any) -> Iterator[None]:
    """llama.cpp's log dropped, the caller's log callback put back after (the callback is the
    process's: hold the model's lock while in it)."""
    old = llama_cpp.llama_log_callback()
    user = ctypes.c_void_p()
    llama_cpp.llama_log_get(ctypes.byref(old), ctypes.byref(user))
    llama_cpp.llama_log_set(_drop_log(), ctypes.c_void_p(0))
    try:
        yield
    finally:
        llama_cpp.llama_log_set(old, user)


@cache
def _drop_log() -> Any:
    """The ctypes log callback that drops every line (made once, kept for the process)."""
    import llama_cpp

    return llama_cpp.llama_log_callback(lambda _level, _text, _user: None)


@dataclass
class WeightReport:
    """What a load did with the weights (``run --json``'s ``weights`` section)."""

    placement: dict[str, Any]
    sites: dict[str, WeightSite]
    experts: frozenset[str]
    anon_bytes_after_load: int | None
    anon_bytes_before_load: int | None = None

    @property
    def repacked(self) -> list[str]:
        """Weights rewritten at load into an extra buffer type (out of the file's mapping)."""
        return sorted(n for n, s in self.sites.items() if s.buffer_type in REPACKED_BUFTS)

    @property
    def buffer_types(self) -> dict[str, int]:
        """How many weights each buffer type holds (``CPU_Mapped``: the file's mapping)."""
        out: dict[str, int] = {}
        for site in self.sites.values():
            out[site.buffer_type] = out.get(site.buffer_type, 0) + 1
        return dict(sorted(out.items()))

    @property
    def experts_unmapped(self) -> list[str]:
        """Expert tensors whose data is not in the file's mapping (copied at load)."""
        return sorted(n for n in self.experts if n in self.sites and not self.sites[n].mapped)

    @property
    def experts_seen(self) -> int:
        return sum(n in self.sites for n in self.experts)

    def to_json(self) -> dict[str, Any]:
        before, after = self.anon_bytes_before_load, self.anon_bytes_after_load
        return {
            **self.placement,
            "repacked": self.repacked,
            "repacked_experts": [n for n in self.repacked if n in self.experts],
            "buffer_types": self.buffer_types,
            "experts_mapped": not self.experts_unmapped and self.experts_seen > 0,
            "experts_unmapped": self.experts_unmapped,
            "weights_seen": len(self.sites),
            "anon_bytes_after_load": after,
            "anon_bytes_of_load": after - before if after is not None and before else None,
        }


def expert_names(model_path: str | os.PathLike[str]) -> tuple[frozenset[str], list[str]]:
    """The routed-expert tensor names of a model and its shard paths."""
    from ...checkpoint.model import MoeModel

    with MoeModel(model_path) as m:
        names = frozenset(t.name for b in m.blocks for t in b.tensors)
        return names, [str(p) for p in m.shard_paths]
