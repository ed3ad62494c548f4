"""Decode as a client of ``moepack serve`` sees it, with and without ``--prefetch``, under the
memory pressure of ``bench_run.py``, against ``run --prefetch``'s own ratio measured in the
same run.

The model and pressure are ``bench_run.py``'s: its synthetic qwen3moe with planted routing
(32 layers x 64 experts, top-8, Q8_0, 3.5 GB; ``--small``: 8 layers) and its prompts, and a
helper holding the rest of RAM (``memhold.MemoryHold``) so that only ``--leave`` bytes stay for
the page cache (``full``: no hold, the model read into the cache first).

For each page-cache size, in alternated pairs (``--pairs``), every one a fresh process:

- ``serve`` and ``serve --prefetch``: the server started on a port the system picks, one short
  warm-up request, then ``--requests`` streamed chat completions through the official
  ``openai`` client, request ``i`` on the model's prompt ``i`` (each a new prompt: nothing of it
  is kept from the previous one), ``--tokens`` tokens each at temperature 0. Measured as the
  client sees it: the time to the first token and the decode rate from the times between
  streamed chunks, ``(chunks - 1) / (last - first)``; and ``/metrics`` after the requests (the
  device's bytes and major faults per decoded token, the prefetcher's time per token, the
  expert bytes resident);
- ``run`` and ``run --prefetch`` (``run_model``) on the same prompts, as llama-cpp-python's
  chat format renders them for the server, ``--tokens`` tokens after each: decode tokens/s as
  ``run`` measures it.

Printed: per configuration the median decode tokens/s (range) and time to first token (and for
the servers what ``/metrics`` said: MB read, major faults and prefetch ms per decoded token,
the share of the expert bytes resident after the requests, decode tokens/s inside), and
the two ratios ``serve --prefetch / serve`` and ``run --prefetch / run``, each the median of
its pairs' ratios; the target is the serve ratio within 10 % of the run ratio. Requests ask
for ASCII text (the byte tokens of 0x80 and above banned through ``logit_bias``): a synthetic
model's arbitrary bytes make llama-cpp-python's streaming re-decode an unfinished character
at every token, which no real text does.

    .venv/bin/python benchmarks/bench_serve.py --dir /tmp/run/bench --leave 1.5G --pairs 3
    .venv/bin/python benchmarks/bench_serve.py --layers 2 --leave full --pairs 1   # a quick check

Two more parts, for the prefix cache (``serve --prefix-cache``):

- ``agent``: an agent's turns through the ``anthropic`` client (streamed), each server a
  fresh process, with the cache and without (``--prefix-cache 0``): turn 1 with a long system
  prompt (``--system-tokens``), a side request with another system prompt, turn 2 (turn 1's
  messages and a few hundred tokens more); and the same two turns with no side request, on
  the same server. Printed: the time to turn 2's first token with and without the side
  request, their ratio (target: within 1.5x with the cache), and turn 2's reused and
  computed prompt tokens (``/metrics``, the request log's counts);
- ``state``: the mechanisms the cache could use, in llama.cpp in this process, on a
  generated model with Qwen3-30B-A3B's KV cache shape (48 layers x 4 KV heads x 128, F16:
  96 KiB a token) and a delta-net hybrid (qwen35moe): bytes per token and the copy's speed
  of llama.cpp's sequence state (``llama_state_seq_get_data`` / ``set_data`` into numpy,
  what ``serve`` uses), llama-cpp-python's ``save_state`` / ``load_state`` (what its
  ``LlamaRAMCache`` stores, logits and token ids with it) and its ``LlamaDiskCache``
  (the same, pickled into a diskcache folder); then the agent's three requests in process
  with no cache, ``LlamaRAMCache`` and moepack's ``PrefixCache``: turn 2's prompt tokens
  computed, and the time the cache took.

    .venv/bin/python benchmarks/bench_serve.py agent --dir /tmp/run/bench --layers 8 --pairs 2
    .venv/bin/python benchmarks/bench_serve.py state --dir /tmp/run/bench --tokens 1000,4000
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_run import ensure_model, read_ahead_kb, resident_fraction, warm  # noqa: E402
from memhold import GIB, MemoryHold, mem_available, parse_size  # noqa: E402
from moepack.checkpoint import MoeModel  # noqa: E402
from moepack.llama.prefetcher.streamer import StreamOptions  # noqa: E402
from moepack.llama.runtime.prompts import text_prompt  # noqa: E402
from moepack.llama.runtime.run import RunOptions, run_model  # noqa: E402

CTX = 512
START_SECONDS = 1800


@dataclass
class Sample:
    config: str
    decode_tps: float
    ttft: float | None = None
    tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    resident: float = 0.0


def ascii_bias(model: Path) -> dict[str, int]:
    """``logit_bias`` banning the model's byte tokens of 0x80 and above."""
    from moepack.checkpoint.gguf_file import GgufFile

    g = GgufFile(model)  # moepack's checked reader: a hostile header is one line, not a trace
    names = g.get("tokenizer.ggml.tokens")
    g.close()
    high = {f"<0x{b:02X}>" for b in range(0x80, 0x100)}
    return {str(i): -100 for i, name in enumerate(names) if name in high}


def chat_prompt(text: str) -> str:
    """``text`` as one user message, rendered as llama-cpp-python's server renders it for a
    model without a chat template (its ``llama-2`` format)."""
    from llama_cpp import llama_chat_format

    return llama_chat_format.format_llama2([{"role": "user", "content": text}]).prompt


def metrics(base: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base + "/metrics", timeout=600) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def serve_once(
    model: Path, prefetch: bool, prompts: list[str], args: argparse.Namespace, bias: dict
) -> Sample:
    """A fresh ``moepack serve``; the client's measurements of ``prompts``, one request each."""
    import openai

    moepack = Path(sys.executable).with_name("moepack")
    cmd = [str(moepack), "serve", str(model), "--port", "0", "--ctx", str(CTX),
           "--threads", str(args.threads)] + (["--prefetch"] if prefetch else [])  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"(http://\S+/v1)", line)
        if not found:
            _, err = proc.communicate(timeout=START_SECONDS)
            raise RuntimeError(f"moepack serve did not start: {line}{err}")
        url = found.group(1)
        client: Any = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=3600)
        alias = model.name.removesuffix(".gguf")
        warmup = [{"role": "user", "content": "hello"}]
        client.chat.completions.create(model=alias, messages=warmup, max_tokens=2, temperature=0)
        rates, firsts, tokens = [], [], 0
        for text in prompts:
            t0 = time.perf_counter()
            times = []
            stream = client.chat.completions.create(
                model=alias, messages=[{"role": "user", "content": text}],
                max_tokens=args.tokens, temperature=0, stream=True, logit_bias=bias,
            )  # fmt: skip
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    times.append(time.perf_counter())
            if len(times) >= 2:
                rates.append((len(times) - 1) / (times[-1] - times[0]))
                firsts.append(times[0] - t0)
                tokens += len(times)
        got = metrics(url.removesuffix("/v1"))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=600)
    name = "serve --prefetch" if prefetch else "serve"
    return Sample(name, statistics.median(rates) if rates else 0.0,
                  statistics.median(firsts) if firsts else None, tokens, got,
                  resident_fraction(model))  # fmt: skip


def run_once(model: Path, prefetch: bool, prompts: list[str], args: argparse.Namespace) -> Sample:
    """``run_model`` on the same prompts: decode tokens/s as ``run`` measures it."""
    options = RunOptions(n_predict=args.tokens, n_ctx=CTX, threads=args.threads,
                         prefetch=StreamOptions() if prefetch else None)  # fmt: skip
    r = run_model(model, [text_prompt(chat_prompt(p)) for p in prompts], options)
    j = r.decode.to_json()
    name = "run --prefetch" if prefetch else "run"
    return Sample(name, r.decode.tokens_per_second, None, r.decode.tokens,
                  {"mb_per_token": j["bytes_read_per_token"] / 1e6,
                   "faults_per_token": j["major_faults_per_token"]},
                  resident_fraction(model))  # fmt: skip


CONFIGS = ["serve", "serve --prefetch", "run", "run --prefetch"]


def measure(label: str, model: Path, prompts: list[str], args: argparse.Namespace,
            bias: dict) -> list[Sample]:  # fmt: skip
    out: list[Sample] = []
    for i in range(args.pairs):
        order = CONFIGS if i % 2 == 0 else list(reversed(CONFIGS))
        for c in order:
            if label == "full":
                warm(model)
            prefetch = c.endswith("--prefetch")
            s = (serve_once(model, prefetch, prompts, args, bias) if c.startswith("serve")
                 else run_once(model, prefetch, prompts, args))  # fmt: skip
            ttft = f"{s.ttft:6.2f} s" if s.ttft is not None else "    -   "
            print(f"  {label:>5} pair {i + 1} {c:<17} {s.decode_tps:8.2f} tok/s  first token "
                  f"{ttft}  {s.tokens} tokens  resident {s.resident:.2f}", flush=True)  # fmt: skip
            out.append(s)
    return out


def _ratio(samples: list[Sample], a: str, b: str) -> float:
    xs = [s for s in samples if s.config == a]
    ys = [s for s in samples if s.config == b]
    pairs = [x.decode_tps / y.decode_tps for x, y in zip(xs, ys, strict=False) if y.decode_tps]
    return statistics.median(pairs) if pairs else float("nan")


def table(label: str, samples: list[Sample]) -> list[str]:
    lines = []
    for c in CONFIGS:
        ss = [s for s in samples if s.config == c]
        tps = [s.decode_tps for s in ss]
        firsts = [s.ttft for s in ss if s.ttft is not None]
        ttft = f"{statistics.median(firsts):7.2f}" if firsts else "      -"
        m = ss[0].metrics if ss else {}
        if c.startswith("serve"):
            mb = statistics.median(
                s.metrics.get("moepack_read_bytes_per_token{phase=decode,window=all}", 0) / 1e6
                for s in ss
            )
            faults = statistics.median(
                s.metrics.get("moepack_major_faults_per_token{phase=decode,window=all}", 0)
                for s in ss
            )
            pf = statistics.median(
                1e3 * s.metrics.get("moepack_prefetch_seconds_per_token{window=all}", 0) for s in ss
            )
            res = statistics.median(
                s.metrics.get("moepack_expert_residency_ratio", float("nan")) for s in ss
            )
            inside = statistics.median(
                s.metrics.get("moepack_tokens_per_second{phase=decode,window=all}", 0) for s in ss
            )
            extra = f"{mb:8.1f} {faults:8.1f} {pf:8.2f} {res:8.2f} {inside:9.2f}"
        else:
            extra = (
                f"{m.get('mb_per_token', 0):8.1f} {m.get('faults_per_token', 0):8.1f}" + " " * 18
            )
        lines.append(f"{label:>5} {c:<17} {statistics.median(tps):8.2f} ({min(tps):.2f}-"
                     f"{max(tps):.2f}) {ttft} {extra}")  # fmt: skip
    serve = _ratio(samples, "serve --prefetch", "serve")
    run = _ratio(samples, "run --prefetch", "run")
    within = abs(serve / run - 1) <= 0.10 if run == run and run else False
    lines.append(f"{label:>5} ratio with --prefetch: serve {serve:.2f}x, run {run:.2f}x; serve/run "
                 f"{serve / run if run else float('nan'):.2f} (target within 10 %: "
                 f"{'yes' if within else 'NO'})")  # fmt: skip
    return lines


HEADER = (" cache config            decode tok/s (range)   TTFT s   MB/tok faults/t pf ms/t "
          "resident  /metrics")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", nargs="?", default="decode", choices=["decode", "agent", "state"],
                    help="decode (default): --prefetch against run; agent, state: the prefix "
                    "cache")  # fmt: skip
    ap.add_argument("--dir", type=Path, default=Path("/tmp/moepack-bench-run"))
    ap.add_argument("--small", action="store_true", help="an 8-layer model (0.9 GB)")
    ap.add_argument("--layers", type=int, default=None, help="layers of the model (default 32)")
    ap.add_argument("--arch", default="qwen3moe", help="synthetic MoE family (moepack synth)")
    ap.add_argument("--leave", default="1.5G",
                    help="page-cache sizes held for, comma-separated; full: no hold")  # fmt: skip
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=3, help="streamed requests per server")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per request")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--system-tokens", type=int, default=4000,
                    help="agent: tokens of turn 1's system prompt")  # fmt: skip
    ap.add_argument("--tokens-list", "--state-tokens", dest="state_tokens", default="1000,2000,4000",
                    help="state: prefix lengths measured")  # fmt: skip
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.part == "state":
        return state_part(args)
    layers = args.layers or (8 if args.small else 32)
    model, prompts = ensure_model(layers, args.dir, args.arch)
    chosen = prompts[: args.requests]
    size = model.stat().st_size
    with MoeModel(model) as m:
        expert_share = m.expert_bytes / size
    bias = ascii_bias(model)
    if args.part == "agent":
        return agent_part(model, args, bias)
    print(f"model {model.name}: {size / 1e9:.2f} GB ({100 * expert_share:.0f} % experts), "
          f"read_ahead_kb {read_ahead_kb(model)}, MemAvailable {mem_available() / GIB:.1f} GiB, "
          f"{args.threads} threads, {len(chosen)} requests x {args.tokens} tokens, "
          f"{args.pairs} alternated pairs, load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    lines: list[str] = []
    for label in args.leave.split(","):
        if label == "full":
            got = measure(label, model, chosen, args, bias)
        else:
            with MemoryHold(parse_size(label)) as hold:
                print(f"holding {hold.held / GIB:.1f} GiB, {hold.available / GIB:.2f} GiB left "
                      f"(model {size / GIB:.2f} GiB)", flush=True)  # fmt: skip
                got = measure(label, model, chosen, args, bias)
                if not hold.alive():
                    print(f"  {label}: the holder let go (MemAvailable < 1 GiB): not valid")
        lines += table(label, got)
    print()
    print(HEADER)
    for line in lines:
        print(line)
    return 0


# -- agent: the time to turn 2's first token with and without a side request ----------------

AGENT_RULE = "rule {i}: the tool t{i} reads the files of folder f{i} and answers in one line. "
AGENT_ASK = "list the rules about the folders f3 and f7"
AGENT_MORE = "now the rules about the folder f11, in the order they were given, one a line. " * 5
AGENT_TITLE = "You write a title of five words for the conversation you are given."


@dataclass
class Turn2:
    ttft: float
    prompt: int
    reused: int


class AgentServer:
    """A fresh ``moepack serve`` (``--prefix-cache 0`` when ``cache`` is off) for the agent's
    turns through the ``anthropic`` client."""

    def __init__(self, model: Path, cache: bool, args: argparse.Namespace, bias: dict) -> None:
        moepack = Path(sys.executable).with_name("moepack")
        ctx = args.system_tokens + 2048
        cmd = [str(moepack), "serve", str(model), "--port", "0", "--ctx", str(ctx),
               "--threads", str(args.threads)] + ([] if cache else ["--prefix-cache", "0"])  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        found = re.search(r"(http://\S+/v1)", line)
        if not found:
            self.proc.kill()
            raise RuntimeError(f"moepack serve did not start: {line}")
        import anthropic

        self.base = found.group(1).removesuffix("/v1")
        self.client = anthropic.Anthropic(base_url=self.base, api_key="none", max_retries=0,
                                          timeout=7200)  # fmt: skip
        self.alias = model.name.removesuffix(".gguf")
        self.extra = {"temperature": 0, "logit_bias": bias}

    def turn(self, system: str, messages: Any, n: int) -> tuple[str, float]:
        """The text of a streamed request and the time to its first text."""
        t0 = time.perf_counter()
        first = None
        with self.client.messages.stream(model=self.alias, max_tokens=n, system=system,
                                         messages=messages, extra_body=self.extra) as s:  # fmt: skip
            for _ in s.text_stream:
                if first is None:
                    first = time.perf_counter() - t0
            text = "".join(b.text for b in s.get_final_message().content if b.type == "text")
        return text, first if first is not None else time.perf_counter() - t0

    def conversation(self, session: int, side: bool, args: argparse.Namespace) -> Turn2:
        """Turn 1, the side request (with ``side``), turn 2: turn 2's figures."""
        rules = "".join(AGENT_RULE.format(i=i) for i in range(args.system_tokens // 70 + 1))
        system = f"Session {session}. {rules}"[: args.system_tokens]
        ask = [{"role": "user", "content": AGENT_ASK}]
        a1, _ = self.turn(system, ask, 8)
        if side:
            self.turn(AGENT_TITLE, ask, 6)
        before = metrics(self.base)
        turns = [
            *ask,
            {"role": "assistant", "content": a1},
            {"role": "user", "content": AGENT_MORE},
        ]
        _, ttft = self.turn(system, turns, 4)
        after = metrics(self.base)
        grew = {k: after.get(k, 0.0) - before.get(k, 0.0)
                for k in ("moepack_prompt_tokens_total", "moepack_prompt_tokens_reused_total")}  # fmt: skip
        return Turn2(ttft, int(grew["moepack_prompt_tokens_total"]),
                     int(grew["moepack_prompt_tokens_reused_total"]))  # fmt: skip

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.communicate(timeout=600)


def agent_part(model: Path, args: argparse.Namespace, bias: dict) -> int:
    print(f"model {model.name}: {model.stat().st_size / 1e9:.2f} GB, system prompt "
          f"{args.system_tokens} tokens, {args.threads} threads, {args.pairs} pairs, load "
          f"{os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    got: dict[tuple[str, bool], list[Turn2]] = {}
    session = 0
    for i in range(args.pairs):
        for cache in (True, False) if i % 2 == 0 else (False, True):
            name = "cache" if cache else "no cache"
            server = AgentServer(model, cache, args, bias)
            try:
                for side in (True, False) if i % 2 == 0 else (False, True):
                    session += 1
                    t = server.conversation(session, side, args)
                    got.setdefault((name, side), []).append(t)
                    print(f"  pair {i + 1} {name:<8} {'side' if side else 'alone':<5} turn 2: "
                          f"ttft {t.ttft:7.2f} s, prompt {t.prompt}, reused {t.reused}",
                          flush=True)  # fmt: skip
            finally:
                server.close()
    print()
    print(" config    turn-2 TTFT s: after a side request   alone   ratio   reused/prompt (side)")
    for name in ("cache", "no cache"):
        after = statistics.median(t.ttft for t in got[(name, True)])
        alone = statistics.median(t.ttft for t in got[(name, False)])
        t = got[(name, True)][-1]
        target = " (target within 1.5x: " + ("yes)" if after / alone <= 1.5 else "NO)")
        print(f" {name:<9} {after:33.2f} {alone:7.2f} {after / alone:6.2f}x   "
              f"{t.reused}/{t.prompt}{target if name == 'cache' else ''}")  # fmt: skip
    return 0


# -- state: the mechanisms measured in llama.cpp ---------------------------------------------


def state_models(folder: Path) -> dict[str, Path]:
    """A model with Qwen3-30B-A3B's KV cache shape (tiny experts), and a qwen35moe hybrid."""
    from moepack.checkpoint.synth import SynthSpec, synth_model

    specs = {
        "kv-30b-a3b": SynthSpec(
            layers=48,
            experts=8,
            top_k=2,
            hidden=256,
            expert_ffn=32,
            heads=4,
            kv_heads=4,
            head_dim=128,
            vocab=300,
            weight_type="Q8_0",
        ),  # fmt: skip
        "qwen35moe": SynthSpec(
            arch="qwen35moe",
            layers=8,
            experts=16,
            top_k=2,
            hidden=256,
            expert_ffn=64,
            heads=4,
            kv_heads=2,
            head_dim=64,
            vocab=300,
            weight_type="Q8_0",
        ),  # fmt: skip
    }
    out = {}
    for name, spec in specs.items():
        path = folder / f"state-{name}.gguf"
        if not path.exists():
            synth_model(path, spec)
        out[name] = path
    return out


def _fastest(f: Any, reps: int = 3) -> tuple[float, Any]:
    best, got = float("inf"), None
    for _ in range(reps):
        t0 = time.perf_counter()
        got = f()
        best = min(best, time.perf_counter() - t0)
    return best, got


def state_copies(path: Path, sizes: list[int], folder: Path) -> None:
    """Bytes per token and copy speed of each mechanism at each prefix length."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=max(sizes) + 64, n_batch=512, n_threads=1,
                          verbose=False)  # fmt: skip
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(3, 255, max(sizes))]
    done = 0
    for n in sizes:
        llm.eval(tokens[done:n])
        done = n
        print(f"  {path.stem:<22} {n:6d} tok {_copies(llm, tokens[:n], folder)}", flush=True)
    llm.close()


def _copies(llm: Any, key: list[int], folder: Path) -> str:
    """One prefix length's line of ``state_copies``."""
    import ctypes
    import shutil

    import llama_cpp
    from llama_cpp.llama_cache import LlamaDiskCache

    ctx = llm._ctx.ctx
    size = int(llama_cpp.llama_state_seq_get_size(ctx, 0))

    def seq_save() -> np.ndarray:  # as serve saves: into a buffer of its own, first touched here
        buf = np.empty(size, dtype=np.uint8)
        llama_cpp.llama_state_seq_get_data(ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                           size, 0)  # fmt: skip
        return buf

    def seq_restore(buf: np.ndarray) -> float:
        ptr = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        return _fastest(lambda: llama_cpp.llama_state_seq_set_data(ctx, ptr, size, 0))[0]

    get, buf = _fastest(seq_save)
    put = seq_restore(buf)
    del buf
    saved, st = _fastest(llm.save_state, reps=2)
    held = st.llama_state_size + st.scores.nbytes + st.input_ids.nbytes
    load, _ = _fastest(lambda: llm.load_state(st), reps=2)
    disk_dir = folder / "state-diskcache"
    disk = LlamaDiskCache(str(disk_dir), capacity_bytes=1 << 40)
    dset, _ = _fastest(lambda: disk.__setitem__(key, st), reps=1)
    dget, _ = _fastest(lambda: disk[key], reps=1)  # it pops the entry: read once
    shutil.rmtree(disk_dir, ignore_errors=True)
    mb = size / 1e6
    return (f"{mb:8.1f} MB {size / len(key):8.0f} B/tok | seq save {mb / get / 1e3:5.2f} GB/s "
            f"restore {mb / put / 1e3:5.2f} GB/s | save_state {held / 1e6:7.1f} MB "
            f"{mb / saved / 1e3:5.2f} GB/s load {mb / load / 1e3:5.2f} GB/s | disk set "
            f"{mb / dset / 1e3:5.2f} GB/s get {mb / dget / 1e3:5.2f} GB/s")  # fmt: skip


def state_agent(path: Path, kind: str) -> str:
    """Turn 1, a side request and turn 2 in process with ``kind`` of cache: turn 2's prompt
    tokens computed and the time in the cache."""
    import llama_cpp
    from llama_cpp.llama_cache import LlamaRAMCache

    from moepack.serve.prefixcache import prefix_cache

    llm: Any = llama_cpp.Llama(str(path), n_ctx=4096, n_batch=512, n_threads=1, verbose=False,
                               chat_format="chatml")  # fmt: skip
    evals: list[int] = []
    inner = llm.eval

    def counting(tokens: Any) -> None:
        evals.append(len(tokens))
        inner(tokens)

    llm.eval = counting
    cache = None
    if kind == "LlamaRAMCache":
        llm.set_cache(LlamaRAMCache(1 << 30))
    elif kind == "PrefixCache":
        cache = prefix_cache(llm, 1 << 30)
    bias = {i: -100.0 for i in range(131, llm.n_vocab())}
    rules = "".join(AGENT_RULE.format(i=i) for i in range(30))
    ask = [{"role": "user", "content": AGENT_ASK}]

    def chat(system: str, messages: Any, n: int) -> tuple[str, int, int]:
        evals.clear()
        r = llm.create_chat_completion([{"role": "system", "content": system}, *messages],
                                       max_tokens=n, temperature=0, logit_bias=bias)  # fmt: skip
        return (str(r["choices"][0]["message"]["content"]), int(r["usage"]["prompt_tokens"]),
                evals[0] if evals else 0)  # fmt: skip

    t0 = time.perf_counter()
    a1, p1, _ = chat(rules, ask, 16)
    chat(AGENT_TITLE, ask, 6)
    turns = [*ask, {"role": "assistant", "content": a1}, {"role": "user", "content": AGENT_MORE}]
    _, p2, computed = chat(rules, turns, 16)
    total = time.perf_counter() - t0
    spent = ""
    if cache is not None:
        s = cache.snapshot()
        spent = f", cache {s['save_seconds'] + s['restore_seconds']:.3f} s"
    llm.close()
    return (f"turn 1 {p1} tokens, turn 2 {p2}: computed {computed}, reused {p2 - computed} "
            f"({total:.1f} s in all{spent})")  # fmt: skip


def state_part(args: argparse.Namespace) -> int:
    sizes = [int(x) for x in args.state_tokens.split(",")]
    models = state_models(args.dir)
    print(f"load {os.getloadavg()[0]:.2f}; copies into and out of memory (seq save/restore: "
          f"llama.cpp's sequence state into numpy; save_state/load_state: llama-cpp-python's, "
          f"its LlamaRAMCache's entries; disk: its LlamaDiskCache)", flush=True)  # fmt: skip
    for path in models.values():
        state_copies(path, sizes, args.dir)
    print("an agent's turn 1, side request and turn 2, in process:", flush=True)
    for name, path in models.items():
        for kind in ("none", "LlamaRAMCache", "PrefixCache"):
            print(f"  {name:<11} {kind:<14} {state_agent(path, kind)}", flush=True)
    return 0


if __name__ == "__main__":
    from moepack.safeio import replacing

    with replacing():  # a benchmark's scratch files are its own, replaced run after run
        sys.exit(main())
