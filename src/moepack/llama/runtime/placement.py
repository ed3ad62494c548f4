"""Where llama.cpp keeps a model's weights: in the file's mapping, or repacked into memory.

On x86 llama.cpp's CPU backend rewrites Q4_0, Q4_K, IQ4_NL and MXFP4 matrices (Q2_K with
AVX-512) at load into the interleaved layouts its faster kernels read (its "extra buffer
type" ``CPU_REPACK``). That copies them into anonymous memory: a Q4_K_M model is read whole
at load, a model larger than RAM is killed, and the experts are no longer in the mapping the
prefetcher reads into. Three placements:

- ``defaults``: llama.cpp's default model parameters (everything repackable is repacked);
- ``experts-mapped``: the routed-expert tensors stay in the plain CPU buffer, that is in the
  mapping, while each dense matrix of a repackable type is sent by name to ``CPU_REPACK``
  (``use_extra_bufts`` off, ``tensor_buft_overrides`` on): the dense weights, resident
  anyway, keep the repacked kernels;
- ``mapped``: no extra buffer types at all.

``auto`` chooses by measurement (``benchmarks/bench_placement.py``, ``docs/run.md``): the
experts stay mapped whenever moepack streams them or the model does not fit (file × ``FIT_FACTOR`` over
the memory available), otherwise ``defaults``: with everything resident the repacked kernels
are worth having (measured in ``docs/run.md``).

A forced buffer type skips llama.cpp's own check, and ``CPU_REPACK`` crashes on a tensor it
has no layout for, so the dense matrices sent there are only those whose type, shape and
role match ggml's rule for this CPU (``ggml-cpu/repack.cpp``), and none on CPUs whose rule
moepack does not know (``experts-mapped`` is then ``mapped``). What llama.cpp really did is
read back after the load (``weights.probe``).
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...checkpoint.gguf_file import TensorEntry
from ...checkpoint.model import MoeModel
from ...errors import BadInput
from ...storage.linux import mem_available
from . import ggml_backend

PLACEMENTS = ("defaults", "experts-mapped", "mapped")
_AUTO: Any = object()  # streaming_llama's default: choice.AutoStream()
CHOICES = ("auto", *PLACEMENTS)
FIT_FACTOR = 1.10
"""``auto`` repacks only when the file times this fits in the memory available (the repacked
copy, and room for the page cache of what is read meanwhile, which the kernel takes back).
1.25 before real scale was measured: at 20 GiB left the 17.24 GB
Qwen3-30B-A3B-shaped Q4_0 repacked ran 3.98 tok/s against 2.88 with its experts mapped,
peak RSS 19.6 GiB, and 1.25 had chosen the mapping (``benchmarks/bench_real.py``)."""

# ggml type -> the CPU feature under which repack.cpp gives it an 8-row layout (x86)
_X86_RULES = {"Q4_0": "AVX2", "Q4_K": "AVX2", "IQ4_NL": "AVX2", "MXFP4": "AVX2", "Q2_K": "AVX512"}
_ROWS = 8
# the dense 2-D weights llama.cpp multiplies with MUL_MAT (never GET_ROWS, never 3-D)
_MATMUL = re.compile(
    r"^(output|blk\.(\d+)\.(attn_(q|k|v|qkv|output|q_a|q_b|kv_a_mqa|kv_b|gate)"
    r"|ffn_(gate|up|down)(_shexp)?))\.weight$"
)


def repackable(entry: TensorEntry, features: frozenset[str]) -> bool:
    """Whether llama.cpp's ``CPU_REPACK`` has a layout for this tensor on this build."""
    need = _X86_RULES.get(entry.type_name)
    if need is None or need not in features or "REPACK" not in features:
        return False
    dims = [n for n in entry.ne[2:] if n != 1]
    return len(entry.ne) >= 2 and not dims and entry.ne[1] % _ROWS == 0


def _repacked_by_default(entry: TensorEntry, features: frozenset[str]) -> bool:
    """Whether llama.cpp's own choice copies this (expert, 3-D) tensor into ``CPU_REPACK``:
    the type's rule and the row count, whatever the number of matrices."""
    need = _X86_RULES.get(entry.type_name)
    return (
        need is not None
        and need in features
        and "REPACK" in features
        and len(entry.ne) >= 2
        and entry.ne[1] % _ROWS == 0
    )


@dataclass(frozen=True)
class WeightPlacement:
    """A placement and why it was chosen; ``repack``: the dense tensors sent to
    ``CPU_REPACK`` by name (``experts-mapped``)."""

    name: str
    reason: str
    repack: tuple[str, ...] = ()
    keep: list[Any] = field(default_factory=list, compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"placement": self.name, "reason": self.reason, "repack_by_name": len(self.repack)}

    def apply(self, params: Any) -> Any:
        """Set ``params`` (a ``llama_model_params``) for this placement; returns it."""
        if self.name == "defaults":
            return params
        params.use_extra_bufts = False
        if self.name == "experts-mapped" and self.repack:
            buft = ggml_backend.cpu_extra_bufts()[ggml_backend.REPACK_BUFT]
            patterns = [p.encode() for p in _patterns(self.repack)]
            arr = (BuftOverride * (len(patterns) + 1))()
            for i, p in enumerate(patterns):
                arr[i].pattern = p
                arr[i].buft = buft
            self.keep.append((arr, patterns))  # llama.cpp reads them during the load
            params.tensor_buft_overrides = ctypes.cast(arr, ctypes.c_void_p)
        return params


class BuftOverride(ctypes.Structure):
    """``struct llama_model_tensor_buft_override`` (llama-cpp-python does not define it)."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _patterns(names: tuple[str, ...]) -> list[str]:
    """Few anchored patterns matching exactly ``names`` (one per tensor role, its layers as
    an alternation): llama.cpp compiles every pattern again for every tensor it loads."""
    layers: dict[str, list[str]] = {}
    out = []
    for name in names:
        m = _MATMUL.match(name)
        if m is None or m.group(2) is None:
            out.append("^" + re.escape(name) + "$")
            continue
        layers.setdefault(m.group(3), []).append(m.group(2))
    for role, ids in layers.items():
        out.append(rf"^blk\.({'|'.join(ids)})\.{role}\.weight$")
    return out


def choose(file_bytes: int, streaming: bool, available: int | None = None) -> tuple[str, str]:
    """``auto``'s placement and the reason, by the measured rule (module docstring)."""
    if streaming:
        return "experts-mapped", "the prefetcher streams the experts from the file's mapping"
    free = mem_available() if available is None else available
    if file_bytes * FIT_FACTOR > free:
        return "experts-mapped", (
            f"the model ({file_bytes / 1e9:.2f} GB) does not fit in the "
            f"{free / 1e9:.2f} GB available with room to repack"
        )
    return "defaults", "the model fits in memory: llama.cpp's repacked kernels"


def nothing_to_stream(
    model: str | os.PathLike[str], memory: int | str = "auto", available: int | None = None
) -> str | None:
    """Why streaming would only cost on ``model`` (None: stream it). When its experts are of a
    type llama.cpp repacks on this CPU, the file fits in the memory available with room to
    repack (× ``FIT_FACTOR``) and no smaller ``memory`` budget was asked for, keeping them in
    the mapping gives up the repacked kernels (1.24× decode and 2.0× prefill on a fully cached
    Q4_K_M, ``docs/run.md``) for reads that never happen: llama.cpp's defaults are faster."""
    features = ggml_backend.cpu_features()
    if ggml_backend.REPACK_BUFT not in ggml_backend.cpu_extra_bufts() or not {"AVX2"} & features:
        return None
    with MoeModel(model) as m:
        size = m.file_bytes
        experts = [m.tensors[t.name] for b in m.blocks for t in b.tensors if t.name in m.tensors]
        if not any(_repacked_by_default(e, features) for e in experts):
            return None
    if isinstance(memory, int) and memory < size:
        return None
    free = mem_available() if available is None else available
    if size * FIT_FACTOR > free:
        return None
    return (
        f"the model ({size / 1e9:.2f} GB) fits in the {free / 1e9:.2f} GB available and "
        "llama.cpp repacks its experts: its own kernels run it faster than streaming would"
    )


def prefetch_unless_idle(
    model: str | os.PathLike[str],
    placement: str,
    prefetch: dict[str, Any] | None,
    warn: Callable[[str], None],
) -> dict[str, Any] | None:
    """The prefetcher's options, or None with one warning where ``nothing_to_stream`` finds
    the model better run by llama.cpp's defaults (``auto`` placement, the pager not forced)."""
    if prefetch is None or placement != "auto" or prefetch.get("pager") == "on":
        return prefetch
    idle = nothing_to_stream(model, prefetch.get("memory", "auto"))
    if idle is None:
        return prefetch
    warn(f"{idle}; the prefetcher stays off (--placement experts-mapped streams anyway)")
    return None


def plan_placement(
    model: str | os.PathLike[str], placement: str = "auto", *, streaming: bool
) -> WeightPlacement:
    """The placement for ``model`` (``auto`` chosen by ``choose``); ``BadInput`` for a name
    that is none of ``CHOICES``."""
    if placement not in CHOICES:
        raise BadInput(f"`placement` is one of {', '.join(CHOICES)}, not {placement!r}")
    with MoeModel(model) as m:
        if placement == "auto":
            name, reason = choose(m.file_bytes, streaming)
        else:
            name, reason = placement, "asked for"
        if name != "experts-mapped":
            return WeightPlacement(name, reason)
        features = ggml_backend.cpu_features()
        if ggml_backend.REPACK_BUFT not in ggml_backend.cpu_extra_bufts() or not (
            {"AVX2"} & features
        ):
            return WeightPlacement(
                "mapped", reason + "; no repack rule known for this CPU: extra buffer types off"
            )
        experts = {t.name for b in m.blocks for t in b.tensors}
        dense = tuple(
            name
            for name, entry in m.tensors.items()
            if name not in experts and _MATMUL.match(name) and repackable(entry, features)
        )
    return WeightPlacement(name, reason, dense)


@contextmanager
def llama_placement(
    model: str | os.PathLike[str], placement: str = "auto", *, streaming: bool = True
) -> Iterator[WeightPlacement]:
    """A ``llama_cpp.Llama`` built inside loads ``model`` with this placement: llama-cpp-python
    asks ``llama_model_default_params()`` for the parameters it then fills, and inside the
    block that answer carries the placement. Not for threads loading other models meanwhile."""
    import llama_cpp.llama_cpp as lc

    plan = plan_placement(model, placement, streaming=streaming)
    original = lc.llama_model_default_params

    def placed() -> Any:
        return plan.apply(original())

    lc.llama_model_default_params = placed
    try:
        yield plan
    finally:
        lc.llama_model_default_params = original


def streaming_llama(
    model_path: str | os.PathLike[str],
    placement: str = "auto",
    *,
    prefetch: Any = _AUTO,
    memory: int | str = "auto",
    warn: Callable[[str], None] | None = None,
    **kwargs: Any,
) -> Any:
    """A ``llama_cpp.Llama`` on ``model_path`` (``kwargs`` as ``Llama`` takes them) run the way
    ``moepack run`` runs it with no flags (``choice.choose_streaming``): where the model does
    not fit in the memory available its experts stay in the file's mapping and the prefetcher
    (the pager, where userfaultfd works) is attached (``llm._moepack_hook``); where it fits,
    llama.cpp's defaults. ``prefetch`` as ``RunOptions.prefetch``: ``StreamOptions`` always,
    None never (with ``placement`` ``experts-mapped`` for a ``prefetching(llm)`` of your own),
    ``AutoStream(options)`` the automatic choice with those options; ``memory`` what the whole
    run may take (``RunOptions.memory``). ``warn`` is told what the prefetcher has to say (the
    pager refused, and why)."""
    from llama_cpp import Llama

    from .choice import AutoStream, choose_streaming
    from .hook import prefetching

    choice = choose_streaming(
        model_path,
        AutoStream() if prefetch is _AUTO else prefetch,
        memory=memory,
        n_ctx=int(kwargs.get("n_ctx", 512)),
        n_batch=int(kwargs.get("n_batch", 512)),
        threads=max(int(kwargs.get("n_threads") or 1), int(kwargs.get("n_threads_batch") or 1)),
    )
    with llama_placement(model_path, placement, streaming=choice.prefetch is not None) as plan:
        llm = Llama(model_path=str(Path(model_path)), **kwargs)
    llm._moepack_placement = plan  # type: ignore[attr-defined]
    llm._moepack_streaming = choice  # type: ignore[attr-defined]
    if choice.prefetch is not None:
        try:
            prefetching(llm, choice.prefetch, warn=warn)
        except BaseException:
            llm.close()
            raise
    return llm
