"""Runs inside a child process: load a GGUF in llama.cpp and save the logits of a token run.

llama.cpp aborts the whole process on some bad inputs (GGML_ASSERT), so the parent never loads
a model itself. Settings are the ones that make comparisons tight: flash attention off and an
F32 KV cache (the defaults differ from a float64 reference by ~1e-3), logits for every token.

Usage: python -m moepack.llama.worker MODEL TOKENS_NPY OUT_NPY THREADS
"""

from __future__ import annotations

import sys

import numpy as np


def main(argv: list[str]) -> int:
    model, tokens_path, out_path, threads = argv
    import llama_cpp

    tokens = np.load(tokens_path).astype(np.int64).tolist()
    llm = llama_cpp.Llama(
        model_path=model,
        n_ctx=max(64, len(tokens) + 8),
        n_batch=max(32, len(tokens)),
        n_ubatch=max(32, len(tokens)),
        n_threads=int(threads),
        n_threads_batch=int(threads),
        logits_all=True,
        flash_attn=False,
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
        seed=0,
        verbose=False,
    )
    llm.eval(tokens)
    np.save(out_path, np.asarray(llm.scores[: len(tokens)], dtype=np.float32))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
