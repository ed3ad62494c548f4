"""An independent float64 forward pass of a qwen3moe GGUF in numpy (F32 weights only).

Written from the architecture (embedding, RMSNorm, Q/K norms, NEOX RoPE, causal grouped-query
attention, softmax router with normalised top-k weights, SwiGLU experts, output head), not from
moepack's code: it is the yardstick the captured routing is checked against.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader


class Qwen3MoeReference:
    def __init__(self, path: Path) -> None:
        r = GGUFReader(path)
        self.w = {t.name: np.asarray(t.data, dtype=np.float64) for t in r.tensors}
        kv = {f.name: f for f in r.fields.values()}

        def num(key: str) -> float:
            f = kv[f"qwen3moe.{key}"]
            return float(f.parts[f.data[0]][0])

        self.n_layer = int(num("block_count"))
        self.n_head = int(num("attention.head_count"))
        self.n_kv = int(num("attention.head_count_kv"))
        self.head_dim = int(num("attention.key_length"))
        self.k = int(num("expert_used_count"))
        self.eps = num("attention.layer_norm_rms_epsilon")
        self.base = num("rope.freq_base")

    def rms(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """NEOX rotation: pairs (i, i + d/2). ``x`` [tokens, heads, d]."""
        d = x.shape[-1]
        inv = self.base ** (-np.arange(0, d // 2) * 2.0 / d)
        ang = pos[:, None] * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def forward(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(top-k ids ``[tokens, layers, k]`` in router order, logits ``[tokens, vocab]``)."""
        w, hd = self.w, self.head_dim
        x = w["token_embd.weight"][np.asarray(tokens)]
        n = len(tokens)
        pos = np.arange(n, dtype=np.float64)
        mask = np.triu(np.full((n, n), -np.inf), 1)
        ids = np.zeros((n, self.n_layer, self.k), dtype=np.int64)
        for il in range(self.n_layer):
            p = f"blk.{il}."
            h = self.rms(x, w[p + "attn_norm.weight"])
            q = (h @ w[p + "attn_q.weight"].T).reshape(n, self.n_head, hd)
            k = (h @ w[p + "attn_k.weight"].T).reshape(n, self.n_kv, hd)
            v = (h @ w[p + "attn_v.weight"].T).reshape(n, self.n_kv, hd)
            q = self.rope(self.rms(q, w[p + "attn_q_norm.weight"]), pos)
            k = self.rope(self.rms(k, w[p + "attn_k_norm.weight"]), pos)
            group = self.n_head // self.n_kv
            out = np.empty_like(q)
            for hh in range(self.n_head):
                kv = hh // group
                s = q[:, hh] @ k[:, kv].T / np.sqrt(hd) + mask
                s = np.exp(s - s.max(axis=1, keepdims=True))
                s /= s.sum(axis=1, keepdims=True)
                out[:, hh] = s @ v[:, kv]
            x = x + out.reshape(n, -1) @ w[p + "attn_output.weight"].T
            h = self.rms(x, w[p + "ffn_norm.weight"])
            logits = h @ w[p + "ffn_gate_inp.weight"].T
            probs = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
            top = np.argsort(-probs, axis=1, kind="stable")[:, : self.k]
            ids[:, il] = top
            chosen = np.take_along_axis(probs, top, axis=1)
            chosen /= chosen.sum(axis=1, keepdims=True)
            moe = np.zeros_like(x)
            gate, up, down = (w[p + f"ffn_{t}_exps.weight"] for t in ("gate", "up", "down"))
            for t in range(n):
                for j, e in enumerate(top[t]):
                    g = gate[e] @ h[t]
                    a = g / (1.0 + np.exp(-g)) * (up[e] @ h[t])
                    moe[t] += chosen[t, j] * (down[e] @ a)
            x = x + moe
        head = w.get("output.weight", w["token_embd.weight"])
        return ids, self.rms(x, w["output_norm.weight"]) @ head.T

    def generate(self, prompt: list[int], n_predict: int) -> tuple[list[int], np.ndarray]:
        """Greedy continuation; (all tokens, their top-k ids)."""
        tokens = list(prompt)
        for _ in range(n_predict):
            _, logits = self.forward(tokens)
            tokens.append(int(np.argmax(logits[-1])))
        ids, _ = self.forward(tokens)
        return tokens, ids
