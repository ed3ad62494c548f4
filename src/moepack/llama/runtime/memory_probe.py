"""Runs inside a child process: what a llama.cpp context of the given shape would allocate,
asked of llama.cpp itself without allocating it.

llama.cpp loads the model's metadata with ``no_alloc`` (its "simulate memory allocations"
mode: nothing mapped, nothing read but the header), makes the context, and prints what its
KV cache, recurrent state and compute buffers would take; this worker catches those lines
from llama.cpp's log and sends the sizes. llama.cpp's own arithmetic covers every family it
runs (sliding-window caches, MLA, delta-net state) without moepack repeating it. The parent
is ``memory_plan.context_needs``.
"""

from __future__ import annotations

import ctypes
import re
import sys
from typing import Any

from ..protocol.child import Channel, could_not_run, worker_main

_MIB = 1 << 20
# llama_kv_cache / llama_memory_recurrent: "size = 8.00 MiB ( 4096 cells, ...)"
_STATE = re.compile(r"^(llama_kv_cache\w*|llama_memory_recurrent\w*): +size = +([\d.]+) MiB")
# sched_reserve: "CPU compute buffer size = 43.01 MiB"
_COMPUTE = re.compile(r"compute buffer size = +([\d.]+) MiB")


def parse_sizes(lines: list[str]) -> dict[str, int]:
    """The KV cache, recurrent state and compute buffer bytes in llama.cpp's log lines."""
    state = compute = 0.0
    for line in "".join(lines).splitlines():
        m = _STATE.search(line.strip())
        if m:
            state += float(m.group(2))
            continue
        m = _COMPUTE.search(line)
        if m:
            compute += float(m.group(1))
    return {"state_bytes": int(state * _MIB), "compute_bytes": int(compute * _MIB)}


def run(job: dict[str, Any], channel: Channel) -> dict[str, Any]:
    import llama_cpp

    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def log(_level: int, text: bytes, _user: Any) -> None:
        lines.append(text.decode("utf-8", errors="replace"))

    llama_cpp.llama_log_set(log, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    mparams.no_alloc = True
    mparams.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE  # a simulated load maps nothing
    model = llama_cpp.llama_model_load_from_file(job["model"].encode(), mparams)
    if not model:
        raise could_not_run("its metadata does not load", job["model"])
    results = []
    try:
        for shape in job["shapes"]:
            cparams = llama_cpp.llama_context_default_params()
            cparams.n_ctx = int(shape["n_ctx"])
            cparams.n_batch = int(shape["n_batch"])
            cparams.n_ubatch = min(int(shape["n_ubatch"]), int(shape["n_batch"]))
            cparams.n_seq_max = 1
            cparams.flash_attn_type = int(shape.get("flash_attn", 0))
            cparams.type_k = cparams.type_v = int(shape.get("kv_type", 1))
            del lines[:]
            ctx = llama_cpp.llama_init_from_model(model, cparams)
            if not ctx:
                raise could_not_run(f"it has no context of {shape['n_ctx']} tokens", job["model"])
            sizes = parse_sizes(lines)
            sizes["n_ctx"] = int(llama_cpp.llama_n_ctx(ctx))
            llama_cpp.llama_free(ctx)
            results.append(sizes)
    finally:
        llama_cpp.llama_model_free(model)
    return {"sizes": results}


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:], run))
