"""A minimal capture of llama.cpp's router choices for the tests of planted routing, until
``moepack trace capture`` is on the main branch: an eval callback reads ``ffn_moe_topk-<il>``
(a strided I32 view [k, n_tokens]) with its strides, in a child process (llama.cpp aborts on
bad models).

As a script: python routing_capture.py MODEL PROMPTS_JSON OUT_NPZ, where PROMPTS_JSON is a
list of token-id lists (BOS is added); OUT_NPZ holds ``ids`` [tokens, layers, k] over all
prompts in order and ``blocks`` (the GGUF block of each layer).
"""

from __future__ import annotations

import ctypes
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

_TOPK = re.compile(rb"^ffn_moe_topk-(\d+)$")


class _Tensor(ctypes.Structure):
    """The head of ggml's ``struct ggml_tensor`` (ggml.h): type, buffer, ne[4], nb[4]."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
    ]


def capture(model: Path, prompts: list[list[int]]) -> tuple[np.ndarray, list[int]]:
    """Top-k ids ``[tokens, layers, k]`` llama.cpp picks on ``prompts`` (child process)."""
    with tempfile.TemporaryDirectory(prefix="moepack-cap-") as d:
        src, out = Path(d) / "prompts.json", Path(d) / "ids.npz"
        src.write_text(json.dumps(prompts))
        proc = subprocess.run(
            [sys.executable, __file__, str(model), str(src), str(out)],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        data = np.load(out)
        return data["ids"], [int(b) for b in data["blocks"]]


def _main(model_path: str, prompts_path: str, out_path: str) -> int:
    import llama_cpp

    base = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    ggml = ctypes.CDLL(str(base))
    ggml.ggml_get_name.restype = ctypes.c_char_p
    ggml.ggml_get_name.argtypes = [ctypes.c_void_p]
    ggml.ggml_nbytes.restype = ctypes.c_size_t
    ggml.ggml_nbytes.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_tensor_get.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
    ]
    rows: dict[int, list[np.ndarray]] = {}

    def on_tensor(t: int, ask: bool, _user: int) -> bool:
        m = _TOPK.match(ggml.ggml_get_name(t) or b"")
        if ask:
            return m is not None
        if m is None:
            return True
        head = _Tensor.from_address(t)
        k, n = int(head.ne[0]), int(head.ne[1])
        nbytes = int(ggml.ggml_nbytes(t))
        buf = (ctypes.c_char * nbytes)()
        ggml.ggml_backend_tensor_get(t, buf, 0, nbytes)
        raw = np.frombuffer(memoryview(buf), dtype=np.uint8)
        view = np.lib.stride_tricks.as_strided(
            raw.view(np.int32), shape=(n, k), strides=(int(head.nb[1]), int(head.nb[0]))
        )
        rows.setdefault(int(m.group(1)), []).append(view.copy())
        return True

    callback = llama_cpp.ggml_backend_sched_eval_callback(on_tensor)
    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), mp)
    if not model:
        print("model did not load", file=sys.stderr)
        return 3
    prompts = json.loads(Path(prompts_path).read_text())
    longest = max(len(p) for p in prompts) + 1
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = max(64, longest)
    cp.n_batch = cp.n_ubatch = max(32, longest)
    cp.n_threads = cp.n_threads_batch = 1
    cp.cb_eval = callback
    cp.cb_eval_user_data = None
    ctx = llama_cpp.llama_init_from_model(model, cp)
    batch = llama_cpp.llama_batch_init(longest, 0, 1)
    for prompt in prompts:
        tokens = [1, *prompt]
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        batch.n_tokens = len(tokens)
        for i, tok in enumerate(tokens):
            batch.token[i] = tok
            batch.pos[i] = i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1
        if llama_cpp.llama_decode(ctx, batch) != 0:
            print("decode failed", file=sys.stderr)
            return 4
    blocks = sorted(rows)
    ids = np.stack([np.concatenate(rows[b]) for b in blocks], axis=1)
    np.savez(out_path, ids=ids, blocks=np.asarray(blocks))
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(_main(*sys.argv[1:4]))
