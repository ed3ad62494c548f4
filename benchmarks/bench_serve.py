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
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    layers = args.layers or (8 if args.small else 32)
    model, prompts = ensure_model(layers, args.dir, args.arch)
    chosen = prompts[: args.requests]
    size = model.stat().st_size
    with MoeModel(model) as m:
        expert_share = m.expert_bytes / size
    bias = ascii_bias(model)
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


if __name__ == "__main__":
    from moepack.safeio import replacing

    with replacing():  # a benchmark's scratch files are its own, replaced run after run
        sys.exit(main())
