"""Runs inside a child process (``child.run_worker``): load a GGUF in llama.cpp and save the
logits of a token run, for the judge.

Settings are the ones that make comparisons tight: flash attention off and an F32 KV cache
(the defaults differ from a float64 reference by ~1e-3), logits for every token.

Job: ``{"model", "tokens" (an .npy of int64 ids), "out" (the .npy written), "threads"}``.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..protocol.child import Channel, could_not_run, worker_main
from ..runtime.session import LlamaSession, SessionParams


def logits_of(job: dict[str, Any], channel: Channel) -> dict[str, Any]:
    """Decode the job's tokens in one batch and save every token's logits."""
    tokens = np.load(job["tokens"]).astype(np.int64).tolist()
    n = max(32, len(tokens))
    params = SessionParams(
        n_ctx=max(64, len(tokens) + 8),
        n_batch=n,
        n_ubatch=n,
        threads=int(job["threads"]),
        kv_type="f32",
    )
    session = LlamaSession(job["model"], params)
    try:
        try:
            session.decode(tokens, 0, all_logits=True)
        except RuntimeError as e:
            raise could_not_run(str(e), job["model"]) from None
        np.save(job["out"], session.logits().astype(np.float32))
    finally:
        session.close()
    return {"tokens": len(tokens)}


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:], logits_of))
