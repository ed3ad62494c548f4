"""Real scale: the models people run, at the memory they have, against the machine's bound.

The models (written once by ``moepack synth --shape``, into ``--dir``, default
``benchmarks/.real-models``; delete a file to write it again):

- ``q4_0``: Qwen3-30B-A3B's shape (qwen3moe, 48 layers, 128 experts top-8) at Q4_0, 17.2 GB;
- ``q4km``: the same at Q4_K_M (llama.cpp's own type mix), 18.6 GB;
- ``q36``: Qwen3.6-35B-A3B's shape (qwen35moe, 40 layers, 256 experts top-8 + a shared
  expert, linear attention in 3 of 4 layers) at Q4_K_M.

Random routing (no planted structure): every expert as likely as the next, what an LRU can do
least with. Every measured run is the real command a user types (``moepack run MODEL ...
--json`` or ``moepack serve MODEL``) in a fresh process, the model file's pages dropped before
it and the drop confirmed with cachestat, under the memory holder (``--leave``: what the rest
of the machine leaves), configurations alternated round by round. A run counts only when the
holder held through it.

Parts (one per invocation; results are appended to ``DIR/results.jsonl`` and ``report``
prints them as tables):

- ``build``: write the models;
- ``fio``: fio's direct random reads of one expert's slices (libaio, QD 8) on the model file:
  the disk's bandwidth, the bound's yardstick;
- ``cached``: decode and prefill with every weight in memory (no holder, warm): llama.cpp's
  defaults at each thread count, on the shape cut to 4 and 12 blocks, carried to the real
  block count on the line through them: the compute time per token;
- ``decode``: the configurations (``--configs``) at each ``--leave`` and thread count, 64
  tokens, against the overlapped bound ``1 / max(io, compute)`` (``io``: the run's bytes per
  token at fio's bandwidth; ``compute``: the ``cached`` part's time per token at the same
  thread count, or at every core for a run that chose its own);
- ``prefill``: prompts of ``--prompt-tokens`` (1k, 4k, 16k) under the holder;
- ``serve``: ``moepack serve MODEL`` with no flags, through the ``openai`` and ``anthropic``
  clients: time to first token and tokens/s;
- ``sweep``: the no-flags run with one setting varied (``--vary lookahead_depth=1,2``): how
  the defaults were chosen;
- ``report``: the tables of everything measured so far.

Configurations (``moepack run`` flags): ``stock`` (``--no-prefetch --placement defaults``:
llama.cpp's own choices, Q4_0/Q4_K repacked into memory at load), ``mapped`` (``--no-prefetch
--placement mapped``: llama.cpp's mmap, nothing repacked), ``auto`` (no flags: what users
get), ``pagecache`` (``--prefetch --pager off``: the page-cache prefetcher), ``pager9g``
(``--prefetch --memory 9G --pager on``: the pager at the budget measured from outside).

    .venv/bin/python benchmarks/bench_real.py build
    .venv/bin/python benchmarks/bench_real.py fio --model q4_0
    .venv/bin/python benchmarks/bench_real.py cached --model q4_0 --threads 1,2
    .venv/bin/python benchmarks/bench_real.py decode --model q4_0 --leave 12G --pairs 2
    .venv/bin/python benchmarks/bench_real.py prefill --model q4_0 --leave 12G
    .venv/bin/python benchmarks/bench_real.py serve --model q4_0 --leave 12G
    .venv/bin/python benchmarks/bench_real.py report
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pager import fio_direct  # noqa: E402
from bench_run import drop_confirmed  # noqa: E402
from memhold import GIB, MemoryHold, parse_size  # noqa: E402
from moepack.checkpoint import MoeModel  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_DIR = HERE / ".real-models"
MODELS: dict[str, tuple[str, str]] = {
    # name: (moepack synth --shape, --weight-type)
    "q4_0": ("qwen3-30b-a3b", "Q4_0"),
    "q4km": ("qwen3-30b-a3b", "Q4_K_M"),
    "q36": ("qwen3.6-35b-a3b", "Q4_K_M"),
}
CONFIGS: dict[str, list[str]] = {
    "stock": ["--no-prefetch", "--placement", "defaults"],
    "mapped": ["--no-prefetch", "--placement", "mapped"],
    "auto": [],
    "pagecache": ["--prefetch", "--pager", "off"],
    "pager9g": ["--prefetch", "--memory", "9G", "--pager", "on"],
}
WORDS = [
    "the",
    "expert",
    "reads",
    "arrive",
    "while",
    "the",
    "layer",
    "computes",
    "and",
    "the",
    "router",
    "chooses",
    "eight",
    "of",
    "the",
    "hundred",
    "and",
    "twenty",
    "eight",
    "experts",
    "for",
    "every",
    "token",
    "of",
    "the",
    "prompt",
]


def moepack() -> str:
    return str(Path(sys.executable).with_name("moepack"))


def model_path(folder: Path, name: str) -> Path:
    shape, wtype = MODELS[name]
    return folder / f"{shape}-{wtype}.gguf"


def record(folder: Path, part: str, row: dict[str, Any]) -> None:
    """One measurement, appended to the results (what ``report`` reads)."""
    row = {"part": part, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **row}
    with open(folder / "results.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")


def results(folder: Path) -> list[dict[str, Any]]:
    path = folder / "results.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- build ---------------------------------------------------------------------------------


def part_build(args: argparse.Namespace) -> None:
    for name in args.models.split(","):
        path = model_path(args.dir, name)
        if path.exists():
            print(f"{name}: {path.name} is there ({path.stat().st_size / 1e9:.2f} GB)")
            continue
        shape, wtype = MODELS[name]
        t0 = time.perf_counter()
        subprocess.run(
            [moepack(), "synth", "--shape", shape, "--weight-type", wtype, "--out", str(path)],
            check=True,
        )
        dt = time.perf_counter() - t0
        size = path.stat().st_size
        print(f"{name}: wrote {size / 1e9:.2f} GB in {dt:.0f} s ({size / dt / 1e6:.0f} MB/s)")
        record(args.dir, "build", {"model": name, "bytes": size, "seconds": dt})


# -- fio and the fully cached compute --------------------------------------------------------


def slice_bytes(path: Path) -> int:
    """One expert's bytes in one layer (its gate, up and down slices together)."""
    with MoeModel(path) as m:
        return sum(t.slice_bytes for t in m.blocks[0].weight_tensors)


def part_fio(args: argparse.Namespace) -> None:
    path = model_path(args.dir, args.model)
    bs = (slice_bytes(path) // 3 + 4095) // 4096 * 4096  # one matrix's slice, page-rounded
    rates = []
    for _ in range(args.pairs):
        drop_confirmed(path)
        rates.append(fio_direct(path, bs, 8))
    gbps = statistics.median(rates) / 1e9
    print(f"{args.model}: fio direct random {bs >> 10} KiB reads at QD 8: {gbps:.2f} GB/s "
          f"(runs {', '.join(f'{r / 1e9:.2f}' for r in rates)})")  # fmt: skip
    record(args.dir, "fio", {"model": args.model, "bs": bs, "gbps": gbps, "runs": rates})


def fio_gbps(folder: Path, model: str) -> float | None:
    rows = [r for r in results(folder) if r["part"] == "fio" and r["model"] == model]
    return rows[-1]["gbps"] if rows else None


def compute_seconds(folder: Path, model: str, threads: int) -> float | None:
    """The fully cached decode time per token at ``threads`` (the ``cached`` part's)."""
    rows = [
        r
        for r in results(folder)
        if r["part"] == "cached" and r["model"] == model and r["threads"] == threads
    ]
    if not rows:
        return None
    return 1.0 / statistics.median(r["decode_tps"] for r in rows)


# -- one run -------------------------------------------------------------------------------


@dataclass
class Sampler:
    """The resident memory of a process and its descendants, sampled every 0.2 s."""

    pid: int
    peak_rss: int = 0
    peak_anon: int = 0
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def _tree(self) -> list[int]:
        out, todo = [], [self.pid]
        while todo:
            p = todo.pop()
            out.append(p)
            try:
                kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
            except OSError:
                kids = []
            todo += [int(k) for k in kids]
        return out

    def _sample(self) -> None:
        rss = anon = 0
        for p in self._tree():
            try:
                for line in Path(f"/proc/{p}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("RssAnon:"):
                        anon += int(line.split()[1]) * 1024
            except OSError:
                pass
        self.peak_rss, self.peak_anon = max(self.peak_rss, rss), max(self.peak_anon, anon)
        self.samples += 1

    def run(self) -> None:
        while not self._stop.wait(0.2):
            self._sample()

    def __enter__(self) -> Sampler:
        self._thread = threading.Thread(target=self.run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def prompt_text(tokens: int) -> str:
    """About ``tokens`` tokens of text: the synthetic vocabulary spells words in letter-pieces,
    about 4.5 tokens a word of ``WORDS`` (512 words were 2,326 tokens); ``run`` reports the
    real count, and the prompts' contexts leave room for the estimate's error."""
    words: list[str] = []
    want = max(1, tokens * 2 // 9)
    while len(words) < want:
        words += WORDS
    return " ".join(words[:want])


def run_once(
    path: Path, config: str, threads: str, tokens: int, prompt: str, ctx: int, extra: list[str]
) -> dict[str, Any]:
    """``moepack run`` once, cold; what it measured and what the machine saw."""
    cmd = [moepack(), "run", str(path), "-p", prompt, "-n", str(tokens), "--json"]
    cmd += ["--ctx", str(ctx)] + CONFIGS[config] + extra
    if threads != "auto":
        cmd += ["-t", threads]
    drop_confirmed(path)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with Sampler(proc.pid) as sampler:
        out, err = proc.communicate()
    wall = time.perf_counter() - t0
    row: dict[str, Any] = {
        "config": config,
        "threads_asked": threads,
        "exit": proc.returncode,
        "wall": wall,
        "peak_rss": sampler.peak_rss,
        "peak_anon": sampler.peak_anon,
        "notes": [ln for ln in err.splitlines() if ln.startswith("moepack:")][:6],
    }
    if proc.returncode != 0:
        row["error"] = err.strip().splitlines()[-1:] if err.strip() else [f"exit {proc.returncode}"]
        return row
    r = json.loads(out)
    dec, pre = r["decode"], r["prefill"]
    stream = r.get("stream") or {}
    pager = stream.get("pager") or {}
    row.update(
        threads=r["threads"],
        threads_batch=r.get("threads_batch"),
        tuning=(r.get("thread_tuning") or {}).get("chosen"),
        engine=(r.get("streaming") or {}).get("engine"),
        decode_tps=dec["tokens_per_second"],
        decode_tokens=dec["tokens"],
        prefill_tps=pre["tokens_per_second"],
        prompt_tokens=r["prompt_tokens"],
        mb_per_token=dec["bytes_read_per_token"] / 1e6,
        prefetch_mb_per_token=dec["prefetch_bytes_per_token"] / 1e6,
        pager_mb_per_token=dec["pager_read_bytes_per_token"] / 1e6,
        cpu_ms_per_token=1e3 * dec["cpu_seconds"] / dec["tokens"] if dec["tokens"] else None,
        prefill_cpu_s=pre["cpu_seconds"],
        prefill_mb=pre["bytes_read_per_token"] * pre["tokens"] / 1e6,
        hit=dec["expert_hit_rate"],
        faults=dec["major_faults_per_token"],
        pager_budget=pager.get("budget_bytes"),
        pager_peak=pager.get("peak_resident_bytes"),
        anon_of_load=(r.get("weights") or {}).get("anon_bytes_of_load"),
        plan=(r.get("streaming") or {}).get("memory"),
        pager=pager or None,
        pinned=stream.get("pinned_bytes"),
        cache=stream.get("cache"),
    )
    return row


def held_runs(
    args: argparse.Namespace,
    leave: int,
    cells: list[tuple[str, str]],
    one: Any,
    part: str,
    extra: dict[str, Any],
) -> list[dict[str, Any]]:
    """Every (config, threads) cell ``args.pairs`` times under one holder, alternated round by
    round; a holder that let go is started again and the run marked invalid."""
    rows: list[dict[str, Any]] = []
    rounds = [cells if i % 2 == 0 else list(reversed(cells)) for i in range(args.pairs)]
    hold: MemoryHold | None = None
    try:
        for cell_round in rounds:
            for config, threads in cell_round:
                if hold is None or not hold.alive():
                    if hold is not None:
                        hold.__exit__(None, None, None)
                    hold = MemoryHold(leave, floor=parse_size(args.hold_floor)).__enter__()
                row = one(config, threads)
                row["held"] = hold.alive()
                row["leave"] = leave
                row["available_at_start"] = hold.available
                rows.append(row)
                record(args.dir, part, {**extra, **row})
                show(row)
    finally:
        if hold is not None:
            hold.__exit__(None, None, None)
    return rows


def show(row: dict[str, Any]) -> None:
    if "error" in row:
        print(f"  {row['config']:>9} t{row['threads_asked']}: failed ({row['error']}), peak "
              f"RSS {row['peak_rss'] / GIB:.1f} GiB, held {row.get('held')}", flush=True)  # fmt: skip
        return
    print(
        f"  {row['config']:>9} t{row['threads_asked']}({row['threads']}/{row['threads_batch']}) "
        f"{row.get('engine')}: decode {row['decode_tps']:.2f} tok/s, prefill "
        f"{row['prefill_tps']:.1f} tok/s ({row['prompt_tokens']} tok), "
        f"{row['mb_per_token']:.0f} MB/tok, CPU {row['cpu_ms_per_token'] or 0:.0f} ms/tok, "
        f"hit {row['hit'] if row['hit'] is None else round(row['hit'], 2)}, peak RSS "
        f"{row['peak_rss'] / GIB:.1f} GiB, held {row.get('held')}",
        flush=True,
    )


# -- the parts under pressure ----------------------------------------------------------------


def part_decode(args: argparse.Namespace) -> None:
    path = model_path(args.dir, args.model)
    prompt = prompt_text(24)
    for leave in [parse_size(x) for x in args.leave.split(",")]:
        print(f"{args.model} decode, {leave / GIB:.0f} GiB left:", flush=True)
        cells = [(c, t) for t in args.threads.split(",") for c in args.configs.split(",")]

        def one(config: str, threads: str) -> dict[str, Any]:
            n = args.stock_tokens if config in ("mapped", "stock") else args.tokens
            return run_once(path, config, threads, n, prompt, 512, [])

        rows = held_runs(args, leave, cells, one, "decode", {"model": args.model})
        headline_decode(args, leave, rows)
    part_report(args, parts=("decode",), only_model=args.model)


def headline_decode(args: argparse.Namespace, leave: int, rows: list[dict[str, Any]]) -> None:
    """The no-flags run's decode against the overlapped bound, stock mapped and the pager at
    9G, as this run measured them (the benchmarks' headline table)."""
    ok = [r for r in rows if r.get("held") and "error" not in r]

    def med(config: str, threads: str | None = None) -> float | None:
        xs = [r["decode_tps"] for r in ok
              if r["config"] == config and (threads is None or r["threads_asked"] == threads)]  # fmt: skip
        return statistics.median(xs) if xs else None

    threads = "auto" if med("auto", "auto") is not None else args.threads.split(",")[0]
    auto = med("auto", threads)
    gbps = fio_gbps(args.dir, args.model)
    mine = [r for r in ok if r["config"] == "auto" and r["threads_asked"] == threads]
    comp = compute_seconds(args.dir, args.model, mine[0]["threads"] if mine else 1)
    if auto is None or not gbps or not comp:
        return
    mb = statistics.median(r["mb_per_token"] for r in mine)
    bound = 1.0 / max(mb * 1e6 / (gbps * 1e9), comp)
    mapped, pager = med("mapped"), med("pager9g")
    from headline import record as headline

    shape, wtype = MODELS[args.model]
    headline(
        f"real-decode-{args.model}-{leave // GIB}g",
        title=f"decode with no flags, {shape} {wtype}, {leave / GIB:.0f} GiB left",
        what="`moepack run MODEL`, no flags: decode tok/s",
        ratio=auto / bound,
        yardstick="of the overlapped bound 1/max(io, compute)",
        yardstick_value=bound,
        unit="tok/s",
        figures={
            "tok_s": auto,
            "mb_per_token": mb,
            "vs_stock_mapped": auto / mapped if mapped else None,
            "vs_pager_9g": auto / pager if pager else None,
            "fio_gbps": gbps,
        },
        model=f"{shape} {wtype}, random routing, {leave / GIB:.0f} GiB left, threads {threads}",
        target=">= 0.9 of the bound at 12 GiB, >= 0.85 at 8 GiB",
        met=(auto / bound) >= (0.85 if leave <= 8 * GIB else 0.9),
    )


def part_prefill(args: argparse.Namespace) -> None:
    path = model_path(args.dir, args.model)
    for leave in [parse_size(x) for x in args.leave.split(",")]:
        for n in [int(x) for x in args.prompt_tokens.split(",")]:
            print(f"{args.model} prefill of ~{n} tokens, {leave / GIB:.0f} GiB left:", flush=True)
            cells = [(c, t) for t in args.threads.split(",") for c in args.configs.split(",")]
            text = prompt_text(n)

            def one(config: str, threads: str, text: str = text, n: int = n) -> dict[str, Any]:
                return run_once(path, config, threads, 1, text, n * 5 // 4 + 256, [])

            held_runs(args, leave, cells, one, "prefill", {"model": args.model, "asked_tokens": n})
    part_report(args, parts=("prefill",), only_model=args.model)


def part_sweep(args: argparse.Namespace) -> None:
    """The no-flags run with one setting varied: ``--vary flag=v1,v2`` (``lookahead-depth=1,2``,
    ``qd=4,8,16``, ``cache=kernel,auto``, ...)."""
    path = model_path(args.dir, args.model)
    flag, _, values = args.vary.partition("=")
    prompt = prompt_text(24)
    leave = parse_size(args.leave.split(",")[0])
    print(f"{args.model} sweep of --{flag}, {leave / GIB:.0f} GiB left:", flush=True)
    cells = [(v, t) for t in args.threads.split(",") for v in values.split(",")]

    def one(value: str, threads: str) -> dict[str, Any]:
        extra = [] if value == "default" else [f"--{flag}", value]
        row = run_once(path, "auto", threads, args.tokens, prompt, 512, extra)
        row["config"] = f"{flag}={value}"
        return row

    held_runs(args, leave, cells, one, "sweep", {"model": args.model, "vary": flag})


SLICES = (4, 12)
"""Blocks of the reduced models the compute is measured on (multiples of 4: the delta-net
shapes keep their one full-attention block in four)."""


def ensure_slice(folder: Path, name: str, layers: int) -> Path:
    """The model's shape with ``layers`` blocks (every other size as the real one)."""
    shape, wtype = MODELS[name]
    path = folder / f"{shape}-{wtype}-L{layers}.gguf"
    if not path.exists():
        subprocess.run(
            [moepack(), "synth", "--shape", shape, "--weight-type", wtype, "--layers",
             str(layers), "--out", str(path), "-q"],
            check=True,
        )  # fmt: skip
    return path


def cached_seconds(path: Path, threads: str, tokens: int, prompt: str) -> tuple[float, float]:
    """llama.cpp's defaults on ``path`` warm, no holder: seconds per decoded token and per
    prompt token."""
    with open(path, "rb", buffering=0) as fh:  # warm
        buf = bytearray(16 << 20)
        while fh.readinto(buf):
            pass
    cmd = [moepack(), "run", str(path), "-p", prompt, "-n", str(tokens), "--json",
           "--no-prefetch", "--placement", "defaults", "-t", threads, "--ctx", "2048"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    r = json.loads(p.stdout)
    return 1.0 / r["decode"]["tokens_per_second"], 1.0 / r["prefill"]["tokens_per_second"]


def part_cached(args: argparse.Namespace) -> None:
    """The compute per token with every weight in memory (llama.cpp's defaults, warm, no
    holder), at each thread count: measured on the shape cut to 4 and 12 blocks and carried to
    the real block count on the line through them (a 17 GB model cached whole leaves this
    24 GiB machine too little to measure it cleanly: its pages and the run's own thrash)."""
    with MoeModel(model_path(args.dir, args.model)) as m:
        blocks = m.block_count
    decode_prompt, prefill_prompt = prompt_text(24), prompt_text(512)
    paths = {layers: ensure_slice(args.dir, args.model, layers) for layers in SLICES}
    for _ in range(args.pairs):
        for threads in args.threads.split(","):
            dec, pre = {}, {}
            for layers, path in paths.items():
                dec[layers] = cached_seconds(path, threads, args.tokens, decode_prompt)[0]
                pre[layers] = cached_seconds(path, threads, 1, prefill_prompt)[1]
            lo, hi = SLICES
            per_dec = (dec[hi] - dec[lo]) / (hi - lo)
            per_pre = (pre[hi] - pre[lo]) / (hi - lo)
            decode_s = dec[lo] + per_dec * (blocks - lo)
            prefill_s = pre[lo] + per_pre * (blocks - lo)
            row = {
                "model": args.model,
                "threads": int(threads),
                "decode_tps": 1.0 / decode_s,
                "prefill_tps": 1.0 / prefill_s,
                "decode_ms_per_block": 1e3 * per_dec,
                "slices": {str(k): [dec[k], pre[k]] for k in SLICES},
            }
            print(f"  cached t{threads}: decode {row['decode_tps']:.2f} tok/s "
                  f"({1e3 * decode_s:.0f} ms/token, {1e3 * per_dec:.1f} ms a block), "
                  f"prefill {row['prefill_tps']:.1f} tok/s", flush=True)  # fmt: skip
            record(args.dir, "cached", row)
    if not args.keep_slices:
        for path in paths.values():
            path.unlink()


def part_serve(args: argparse.Namespace) -> None:
    """``moepack serve MODEL`` (no flags) under the holder, through both clients."""
    import anthropic
    import openai

    path = model_path(args.dir, args.model)
    leave = parse_size(args.leave.split(",")[0])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    drop_confirmed(path)
    with MemoryHold(leave, floor=parse_size(args.hold_floor)) as hold:
        proc = subprocess.Popen(
            [moepack(), "serve", str(path), "--port", str(port), "--ctx", "4096"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            print(f"  {line.strip()}", flush=True)
            base = f"http://127.0.0.1:{port}"
            oa = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=3600)
            an = anthropic.Anthropic(base_url=base, api_key="none", timeout=3600)
            content = prompt_text(args.serve_prompt)
            for i in range(args.pairs):
                for client in ("openai", "anthropic") if i % 2 == 0 else ("anthropic", "openai"):
                    t0 = time.perf_counter()
                    first, pieces = None, 0
                    if client == "openai":
                        stream = oa.chat.completions.create(
                            model=path.stem, messages=[{"role": "user", "content": content}],
                            max_tokens=args.tokens, temperature=0, stream=True,
                        )  # fmt: skip
                        for ch in stream:
                            if ch.choices and ch.choices[0].delta.content:
                                first = first or time.perf_counter()
                                pieces += 1
                    else:
                        with an.messages.stream(
                            model=path.stem, max_tokens=args.tokens,
                            messages=[{"role": "user", "content": content}],
                        ) as st:  # fmt: skip
                            for _text in st.text_stream:
                                first = first or time.perf_counter()
                                pieces += 1
                    end = time.perf_counter()
                    ttft = (first or end) - t0
                    tps = (pieces - 1) / (end - first) if first and pieces > 1 else 0.0
                    row = {"model": args.model, "client": client, "ttft": ttft,
                           "decode_tps": tps, "pieces": pieces, "leave": leave,
                           "held": hold.alive()}  # fmt: skip
                    print(f"  {client}: TTFT {ttft:.1f} s, {tps:.2f} tok/s ({pieces} pieces), "
                          f"held {hold.alive()}", flush=True)  # fmt: skip
                    record(args.dir, "serve", row)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()


# -- report --------------------------------------------------------------------------------


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def part_report(
    args: argparse.Namespace, parts: tuple[str, ...] = ("decode", "prefill"), only_model: str = ""
) -> None:
    rows = results(args.dir)
    for part in parts:
        cells: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        for r in rows:
            if r["part"] != part or (only_model and r["model"] != only_model):
                continue
            key = (
                r["model"],
                r["leave"],
                r.get("asked_tokens", 0),
                r["threads_asked"],
                r["config"],
            )
            cells.setdefault(key, []).append(r)
        if not cells:
            continue
        print(f"\n{part}:")
        print("| model | left | prompt | threads | config | tok/s (runs) | MB/token | CPU ms/token "
              "| bound tok/s | of bound | peak RSS GiB | valid |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for (model, leave, asked, threads, config), rs in sorted(cells.items()):
            ok = [r for r in rs if r.get("held") and "error" not in r]
            metric = "decode_tps" if part == "decode" else "prefill_tps"
            tps = [r[metric] for r in ok]
            mb = _med([r["mb_per_token"] for r in ok])
            cpu = _med([r["cpu_ms_per_token"] or 0 for r in ok])
            bound = ""
            share = ""
            gbps = fio_gbps(args.dir, model)
            t = int(threads) if threads != "auto" else os.cpu_count() or 1
            comp = compute_seconds(args.dir, model, t)
            if part == "decode" and gbps and comp and ok:
                b = 1.0 / max(mb * 1e6 / (gbps * 1e9), comp)
                bound = f"{b:.2f}"
                share = f"{_med(tps) / b:.2f}"
            errors = [r.get("error") for r in rs if "error" in r]
            runs = ", ".join(f"{x:.2f}" for x in tps)
            print(f"| {model} | {leave / GIB:.0f} GiB | {asked or ''} | {threads} | {config} | "
                  f"{_med(tps):.2f} ({runs}) | {mb:.0f} | {cpu:.0f} | {bound} | {share} | "
                  f"{max([r['peak_rss'] for r in rs] or [0]) / GIB:.1f} | "
                  f"{len(ok)}/{len(rs)}{' ' + str(errors[0]) if errors else ''} |")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=["build", "fio", "cached", "decode", "prefill", "serve",
                                     "sweep", "report"])  # fmt: skip
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--model", default="q4_0", choices=list(MODELS))
    ap.add_argument("--leave", default="12G", help="memory left by the holder (comma list)")
    ap.add_argument("--threads", default="1,2", help="thread counts; auto: run chooses")
    ap.add_argument("--configs", default="auto,pager9g,pagecache,mapped")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--stock-tokens", type=int, default=16, help="decode tokens of stock runs")
    ap.add_argument("--prompt-tokens", default="1024,4096")
    ap.add_argument("--serve-prompt", type=int, default=1024)
    ap.add_argument("--vary", default="lookahead-depth=1,2")
    ap.add_argument("--hold-floor", default="256M")
    ap.add_argument("--keep-slices", action="store_true", help="keep cached's reduced models")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    parts = {
        "build": part_build,
        "fio": part_fio,
        "cached": part_cached,
        "decode": part_decode,
        "prefill": part_prefill,
        "serve": part_serve,
        "sweep": part_sweep,
        "report": part_report,
    }
    parts[args.part](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
