"""Decode at the disk's speed: stock llama.cpp (its mmap faults) against ``moepack run
--prefetch`` in its configurations, under memory pressure, with the physical bounds measured
in the same run.

The model: a synthetic qwen3moe of 3.5 GB with planted routing that llama.cpp really follows
(``moepack synth --routing cluster=8,stay=0.8,coupling=0.95,skew=1``: 32 layers x 64 experts,
top-8, Q8_0, hidden 1024, expert FFN 512: 544 KiB slices), written once into ``--dir`` with
its topic-moving prompts. Decode feeds the rest of one prompt token by token
(``run_model(continuation=…)``), so decode routes like that text.

What one run measures, in this order:

1. **the disk** at the request sizes and depth the prefetcher issues: fio's buffered random
   reads of one expert slice with 8 readers (the yardstick), and the prefetcher's own read-ahead
   thread (``fetcher``) asking for 24 random slices at a time, as a decode layer's misses come,
   each batch waited for until resident, every read cold (the file's pages dropped first and
   confirmed with cachestat);
2. **compute**: every configuration's decode with the whole model cached, at each thread count
   (the compute time per token; also the fully-cached ratio against stock);
3. **under pressure** (``--leave``: a helper holds the rest of RAM): each configuration at each
   thread count, in alternated pairs, every run a fresh process, every decode cold (the
   model's own pages dropped after the prompt; nothing machine-wide), logits compared with
   stock's bit for bit;
4. **the model of the run**: the overlapped run's routing captured, replayed through
   ``replay --policy lru`` at the run's own cache budget with buffered reads: predicted expert
   hit rate and I/O time per token against the run's measured ones (the disk's busy time,
   ``io_ticks`` of its ``/sys/block`` stat);
5. **prefill** of a 512-token prompt under pressure, stock against the prefetch, and against
   the bound of reading every expert that prompt touches at the probed bandwidth.

Printed per configuration: decode tokens/s (median, range), the median pair ratio against
stock, MB read per token (the device's, ``/proc/self/io``), the prefetcher's bytes, the
expert hit rate, major faults and CPU ms per token, and the bounds ``1/(io+compute)``
(serial) and ``1/max(io, compute)`` (overlapped) with ``io`` = that configuration's bytes per
token at the probed bandwidth and ``compute`` the fully-cached time per token.

Configurations: ``stock``; ``serial`` (the prefetcher before overlap: each layer's reads
finished before it computes, ``threads`` QD 8, nothing pinned, the kernel's read-around and
eviction); ``overlap`` (the defaults: reads beside compute, router lookahead, dense weights
locked, the live LRU cache); ``overlap-nola`` (no lookahead), ``overlap-kernel`` (the kernel
evicts, no live cache), ``overlap-nopin`` (nothing locked); ``reordered`` (``overlap`` on the
file repacked with a plan from routing captured on other prompts).

    .venv/bin/python benchmarks/bench_run.py --dir /tmp/run/bench --leave 1.5G --pairs 3
    .venv/bin/python benchmarks/bench_run.py --small      # an 8-layer model, a quick check
    .venv/bin/python benchmarks/bench_run.py --weight-type Q4_K_M --configs overlap

``--weight-type Q4_K_M`` (48 layers, 2.7 GB): llama.cpp's defaults repack Q4_K at load into
anonymous memory. ``stock`` keeps them (``placement defaults``) and is measured fully cached,
and under pressure once per thread count in a hold of its own (``stock_check``: its anonymous
memory after load, and whether the holder had to let go); ``stock-mapped`` (the experts left
in the file's mapping, ``placement experts-mapped``, no prefetcher) is the reference the
prefetching configurations are compared with bit for bit, as ``stock`` is for Q8_0.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_storage import ensure_fio  # noqa: E402
from headline import record  # noqa: E402
from memhold import GIB, MemoryHold, mem_available, parse_size  # noqa: E402
from moepack.checkpoint import MoeModel  # noqa: E402
from moepack.checkpoint.fused_archs import takes_fused_gate_up  # noqa: E402
from moepack.layout.coactivation_plan import plan_files  # noqa: E402
from moepack.layout.plan import Plan, load_plan, save_plan  # noqa: E402
from moepack.llama.prefetcher.fetcher import make_fetcher, willneed_window  # noqa: E402
from moepack.llama.prefetcher.prefetch import ExpertRanges  # noqa: E402
from moepack.llama.prefetcher.streamer import StreamOptions  # noqa: E402
from moepack.llama.runtime.run import RunOptions, RunResult, run_model  # noqa: E402
from moepack.pages import drop_cached  # noqa: E402
from moepack.rewrite.repack import repack  # noqa: E402
from moepack.storage import linux  # noqa: E402
from moepack.storage.device import describe_device  # noqa: E402
from moepack.storage.modes import Mode  # noqa: E402
from moepack.stream.budget import CacheBudget  # noqa: E402
from moepack.stream.command import replay_command  # noqa: E402
from moepack.stream.forecast import fit, overlap  # noqa: E402
from moepack.stream.replay import ReplayOptions  # noqa: E402
from moepack.stream.simulate import HitRates, layer_hits  # noqa: E402
from moepack.trace.cache_policy import POLICIES  # noqa: E402
from moepack.trace.formats import load_trace  # noqa: E402

MADV_POPULATE_READ = 22  # Linux 5.14; Python 3.11's mmap module has no name for it

SYNTH_ARGS = [
    "--experts",
    "64",
    "--top-k",
    "8",
    "--hidden",
    "1024",
    "--expert-ffn",
    "512",
    "--heads",
    "8",
    "--kv-heads",
    "2",
    "--head-dim",
    "128",
    "--vocab",
    "4096",
    "--routing",
    "cluster=8,stay=0.8,coupling=0.95,skew=1",
    "--prompts",
    "16",
    "--prompt-tokens",
    "128",
    "--seed",
    "7",
]


WEIGHT_TAGS = {"Q8_0": "q8", "Q4_0": "q40", "Q4_K_M": "q4km"}


def ensure_model(
    layers: int, folder: Path, arch: str, planted: bool = True, weight_type: str = "Q8_0"
) -> tuple[Path, list[str]]:
    """The planted-routing model and its prompts, written once (reused when present); with
    ``planted`` false, the same shapes with random routing (no structure a predictor can
    use), decoding the planted model's prompts. Q4_K_M is quantised by llama.cpp from F32."""
    name = "moe" if arch == "qwen3moe" else arch  # the qwen3moe file keeps its old name
    tag = WEIGHT_TAGS[weight_type]
    routed = folder / f"{name}-{layers}x64-{tag}-routed.gguf"
    path = routed if planted else folder / f"{name}-{layers}x64-{tag}-random.gguf"
    prompts = routed.with_suffix(".prompts.txt")
    if not path.exists() or (planted and not prompts.exists()):
        print(f"writing {path} ...", flush=True)
        moepack = Path(sys.executable).with_name("moepack")
        cmd = [str(moepack), "synth", "--out", str(path), "--layers", str(layers), "--arch", arch,
               "--weight-type", weight_type]  # fmt: skip
        if planted:
            cmd += [*SYNTH_ARGS, "--prompts-out", str(prompts)]
        else:
            cut = SYNTH_ARGS.index("--routing")
            cmd += SYNTH_ARGS[:cut] + ["--seed", "7"]
        subprocess.run([*cmd, "-q"], check=True)
    return path, prompts.read_text(encoding="utf-8").splitlines()


def ensure_plan(model: Path, prompts: list[str], threads: int) -> Plan:
    """A plan from routing llama.cpp produced on other prompts than the measured one."""
    path = model.with_suffix(".plan.json")
    if path.exists():
        return load_plan(path)
    trace = model.with_suffix(".moetrace")
    print("capturing routing for the plan (held-out prompts) ...", flush=True)
    run_model(
        model, " ".join(prompts[1:4]), RunOptions(n_predict=0, threads=threads), trace_out=trace
    )
    outcome = plan_files(model, trace)
    save_plan(outcome.plan, path)
    return outcome.plan


def ensure_rewrite(model: Path, layout: str, prompts: list[str], threads: int) -> Path:
    """``model`` repacked as ``layout`` (a reorder with the plan of ``ensure_plan``)."""
    suffix = "reordered" if layout == "reorder" else layout.replace("+", "-")
    out = model.with_name(f"{model.stem}-{suffix}.gguf")
    if out.exists():
        return out
    plan = ensure_plan(model, prompts, threads) if "reorder" in layout else None
    print(f"writing {out.name} ({layout}) ...", flush=True)
    repack(model, plan, out, layout=None if layout == "reorder" else layout)
    return out


# -- configurations ------------------------------------------------------------------------

SERIAL = StreamOptions(mode="serial", lookahead="none", pin_dense="off", cache="kernel")
CONFIGS: dict[str, dict[str, Any]] = {
    # config: (RunOptions fields); "prefetch" is a StreamOptions or None
    "stock": {"prefetch": None, "placement": "defaults"},  # llama.cpp's own model parameters
    # llama.cpp's page faults with the experts in the mapping (what `run` does without
    # --prefetch on a model that does not fit): the bit-exact reference of a repacked type
    "stock-mapped": {"prefetch": None, "placement": "experts-mapped"},
    "serial": {"prefetch": SERIAL, "readaround": "on"},
    "overlap": {"prefetch": StreamOptions()},
    "overlap-nola": {"prefetch": StreamOptions(lookahead="none")},
    "overlap-kernel": {"prefetch": StreamOptions(cache="kernel")},
    "overlap-nopin": {"prefetch": StreamOptions(pin_dense="off")},
    "reordered": {"prefetch": StreamOptions()},
    "fused": {"prefetch": StreamOptions()},
    "fused-reordered": {"prefetch": StreamOptions()},
}
REWRITES: dict[str, str | None] = {"reordered": "reorder", "fused": "fused",
                                   "fused-reordered": "fused+reorder"}  # fmt: skip


def read_ahead_kb(path: Path) -> str:
    try:
        dev = describe_device(path).block_device
        return (Path("/sys/block") / str(dev) / "queue" / "read_ahead_kb").read_text().strip()
    except (OSError, AttributeError):
        return "?"


def disk_busy_ms(path: Path) -> int:
    """``io_ticks`` of the disk holding ``path``: milliseconds it had I/O in flight."""
    dev = describe_device(path).block_device
    fields = (Path("/sys/block") / str(dev) / "stat").read_text().split()
    return int(fields[9])


def resident_fraction(path: Path) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        pages = linux.cachestat(fd, 0, 0).nr_cache
    finally:
        os.close(fd)
    return pages * linux.PAGE_SIZE / path.stat().st_size


def warm(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(16 << 20)
        while f.readinto(buf):
            pass


def drop_confirmed(path: Path) -> None:
    """Drop the file's pages and confirm with cachestat (cold means cold)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(20):
            drop_cached(fd)
            if linux.cachestat(fd, 0, 0).nr_cache == 0:
                return
            time.sleep(0.05)
        left = linux.cachestat(fd, 0, 0).nr_cache * linux.PAGE_SIZE
        print(f"  note: {left / 1e6:.1f} MB of {path.name} stayed cached (mapped elsewhere)")
    finally:
        os.close(fd)


# -- 1. the disk ---------------------------------------------------------------------------


@dataclass
class DiskProbe:
    slice_bytes: int
    fio_gbps: float  # fio, buffered randread, 8 readers, one slice per request
    fetch_gbps: float  # the prefetcher's read-ahead thread, 24 slices at a time
    fetcher: str

    @property
    def ratio(self) -> float:
        return self.fetch_gbps / self.fio_gbps if self.fio_gbps else 0.0


def fio_buffered(path: Path, bs: int, jobs: int) -> float:
    """fio's buffered random reads (bytes/s): ``jobs`` readers of ``bs``, each over its own
    eighth of the file, every block read once (cold: fio drops the file's cache first)."""
    fio = ensure_fio()
    region = path.stat().st_size // jobs // bs * bs
    cmd = [
        fio, "--name=buffered", f"--filename={path}", "--rw=randread", f"--bs={bs}",
        "--direct=0", "--ioengine=psync", f"--numjobs={jobs}", "--group_reporting",
        f"--size={region}", f"--offset_increment={region}", "--invalidate=1",
        "--output-format=json",
    ]  # fmt: skip
    drop_confirmed(path)
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(json.loads(p.stdout[p.stdout.index("{") :])["jobs"][0]["read"]["bw_bytes"])


def fetch_probe(path: Path, batch: int, seed: int = 0) -> tuple[float, str]:
    """The read-ahead thread's bytes/s: every expert slice of the file once, in random order,
    ``batch`` of one layer at a time (as a layer's misses come), each batch waited for until
    resident (``MADV_POPULATE_READ`` on a map of the file); cold from the start."""
    with MoeModel(path) as m:
        layout = ExpertRanges(m)
    rng = np.random.default_rng(seed)
    work = []
    for block in layout.blocks:
        per_matrix = max(1, batch // layout.table(block).shape[0])
        ids = rng.permutation(layout.n_expert[block])
        work += [(block, ids[i : i + per_matrix]) for i in range(0, ids.size, per_matrix)]
    order = rng.permutation(len(work))
    drop_confirmed(path)
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    fetcher = make_fetcher([fd], willneed_window(path), True)
    total, t0 = 0, time.perf_counter()
    try:
        for i in order:
            block, ids = work[i]
            rows = layout.slice_rows(block, ids)
            fetcher.demand(block, rows)
            fetcher.wait_idle()
            for _shard, _e, off, n in rows:
                lo = int(off) // mmap.PAGESIZE * mmap.PAGESIZE
                mm.madvise(MADV_POPULATE_READ, lo, int(off) + int(n) - lo)
            total += int(rows[:, 3].sum())
        dt = time.perf_counter() - t0
    finally:
        kind = fetcher.kind
        fetcher.close()
        mm.close()
        os.close(fd)
    return total / dt, kind


def probe_disk(path: Path, rounds: int) -> DiskProbe:
    """fio and the prefetcher's read-ahead, alternated ``rounds`` times; medians."""
    with MoeModel(path) as m:
        slice_bytes = m.blocks[0].weight_tensors[0].slice_bytes
    fio, got = [], []
    for seed in range(rounds):
        fio.append(fio_buffered(path, slice_bytes, 8))
        got.append(fetch_probe(path, 24, seed))
    fio_gbps = statistics.median(fio)
    return DiskProbe(slice_bytes, fio_gbps / 1e9, statistics.median(g[0] for g in got) / 1e9,
                     got[0][1])  # fmt: skip


# -- 2.-3. runs ----------------------------------------------------------------------------


@dataclass
class Sample:
    config: str
    threads: int
    result: RunResult
    resident: float
    busy_ms: int  # the disk's busy time during the whole run
    identical: bool | None = None  # logits equal to stock's of the same pair

    def row(self) -> dict[str, float]:
        d = self.result.decode
        j = d.to_json()
        return {
            "tps": d.tokens_per_second,
            "prefill": self.result.prefill.tokens_per_second,
            "faults": j["major_faults_per_token"],
            "mb_read": j["bytes_read_per_token"] / 1e6,
            "mb_prefetch": j["prefetch_bytes_per_token"] / 1e6,
            "hit": j["expert_hit_rate"] if j["expert_hit_rate"] is not None else float("nan"),
            "cpu_ms": 1e3 * j["cpu_seconds"] / d.tokens if d.tokens else 0.0,
            "resident": self.resident,
        }


def one_run(
    config: str, path: Path, args: argparse.Namespace, threads: int, cold: bool, logits: Path
) -> Sample:
    words = args.prompt.split()
    options = RunOptions(n_predict=args.tokens, n_ctx=256, threads=threads, cold=cold,
                         **CONFIGS[config])  # fmt: skip
    busy0 = disk_busy_ms(path)
    r = run_model(path, " ".join(words[:16]), options, continuation=" ".join(words[16:]),
                  logits_out=logits)  # fmt: skip
    return Sample(config, threads, r, resident_fraction(path), disk_busy_ms(path) - busy0)


def measure(
    label: str,
    files: dict[str, Path],
    configs: list[str],
    args: argparse.Namespace,
    thread_counts: list[int] | None = None,
) -> list[Sample]:
    """Every configuration at every thread count, ``args.pairs`` times, order alternating."""
    full = label == "full"
    out: list[Sample] = []
    logits = args.dir / "logits"
    logits.mkdir(exist_ok=True)
    for threads in thread_counts or args.threads:
        for i in range(args.pairs):
            order = configs if i % 2 == 0 else list(reversed(configs))
            got: dict[str, Sample] = {}
            for c in order:
                if full:
                    warm(files[c])
                got[c] = one_run(c, files[c], args, threads, not full, logits / f"{c}.npy")
            base = np.load(logits / f"{args.ref}.npy") if args.ref in got else None
            for c, s in got.items():
                if base is not None:
                    s.identical = bool(np.array_equal(np.load(logits / f"{c}.npy"), base))
                row = s.row()
                print(f"  {label:>5} t{threads} pair {i + 1} {c:<15} {row['tps']:7.2f} tok/s  "
                      f"MB/tok {row['mb_read']:7.1f}  hit {row['hit']:.2f}  "
                      f"identical {s.identical}", flush=True)  # fmt: skip
                out.append(s)
    return out


def compute_seconds(full: list[Sample]) -> dict[tuple[str, int], float]:
    """Decode seconds per token with the whole model cached, per (config, threads)."""
    out: dict[tuple[str, int], list[float]] = {}
    for s in full:
        out.setdefault((s.config, s.threads), []).append(1 / s.row()["tps"])
    return {k: statistics.median(v) for k, v in out.items()}


def table(
    label: str, samples: list[Sample], probe: DiskProbe, compute: dict, ref: str = "stock"
) -> list[str]:
    """One line per (threads, configuration): ratios, identity and the compute bound against
    ``ref`` (stock; stock-mapped on a repacked type, whose stock sums in another order)."""
    lines = []
    keys = sorted(
        {(s.threads, s.config) for s in samples}, key=lambda k: (k[0], list(CONFIGS).index(k[1]))
    )
    for threads, c in keys:
        ss = [s for s in samples if s.config == c and s.threads == threads]
        stock = [s for s in samples if s.config == ref and s.threads == threads]
        rows = [s.row() for s in ss]
        tps = [r["tps"] for r in rows]
        ratio = (statistics.median(a.row()["tps"] / b.row()["tps"] for a, b in zip(ss, stock, strict=False))
                 if stock and c != ref else 1.0)  # fmt: skip

        def med(key: str, rows: list[dict[str, float]] = rows) -> float:
            return statistics.median(r[key] for r in rows)

        io = med("mb_read") * 1e6 / (probe.fetch_gbps * 1e9)
        comp = compute.get((ref, threads), float("nan"))
        serial_bound, overlap_bound = 1 / (io + comp), 1 / max(io, comp)
        same = all(s.identical for s in ss) if c != ref else True
        lines.append(
            f"{label:>5} t{threads} {c:<15} {statistics.median(tps):6.2f} ({min(tps):.2f}-{max(tps):.2f})"
            f" {ratio:6.2f}x {med('mb_read'):7.1f} {med('mb_prefetch'):7.1f} {med('hit'):5.2f}"
            f" {med('faults'):6.1f} {med('cpu_ms'):7.1f} {med('prefill'):7.2f}"
            f"  {serial_bound:5.2f} {overlap_bound:5.2f} {statistics.median(tps) / overlap_bound:5.2f}"
            f"  {'yes' if same else 'NO'}"
        )  # fmt: skip
    return lines


HEADER = (" cache  thr config          tok/s (range)   vs stock  MB/tok pf MB/t   hit faults"
          " CPU ms/t prefill  serial  overl  of bound  logits =")  # fmt: skip


# -- 4. the model of the run ---------------------------------------------------------------


def model_check(model: Path, args: argparse.Namespace, overlap: list[Sample]) -> list[str]:
    """``replay --policy lru`` at the overlapped runs' cache budget, on their own routing,
    against what they measured."""
    if not overlap or not overlap[0].result.stream:
        return ["  (no overlapped run under pressure to check)"]
    cache = overlap[0].result.stream.get("cache") or {}
    budget = cache.get("budget_bytes")
    if not budget:
        return ["  (the overlapped run used no live cache: nothing to predict with)"]
    trace = args.dir / "decode.moetrace"
    words = args.prompt.split()
    run_model(model, " ".join(words[:16]), RunOptions(n_predict=args.tokens, n_ctx=256, threads=1),
              continuation=" ".join(words[16:]), trace_out=trace)  # fmt: skip
    opts = ReplayOptions(CacheBudget(bytes=int(budget)), policy="lru", engine="threads",
                         queue_depth=8, mode=Mode.BUFFERED)  # fmt: skip
    # the runs drop the file's pages after the prompt and start decode with an empty live
    # cache: the replay starts there too (the decode's tokens only, from an empty cache)
    with MoeModel(model) as m:
        first = int(np.argmax(load_trace(trace, model=m).phase_mask("decode")))
    rep = replay_command(model, trace, opts, token_range=f"{first}:").replay.to_json()
    rates = rep.get("hit_rate") or {}
    hits = rates.get("decode", rates.get("lifetime"))
    io_pred = rep["io_us_per_token"] / 1e6 if rep.get("io_us_per_token") else None
    lines = [f"  replay --policy lru --cache {budget / GIB:.2f}G (buffered threads QD 8), "
             f"decode tokens {first}: of a trace of the same run ({rep.get('tokens', '?')} "
             "tokens replayed, empty cache first, as the runs' decode)"]  # fmt: skip
    if not model.with_suffix(".moetrace").exists():  # the other prompts' routing (no plan yet)
        ensure_plan(model, args.prompts, 1)
    lines += policy_check(model, trace, int(budget))
    lines += lookahead_check(model, trace, args)
    for s in overlap:
        d = s.result.decode
        pf = d.prefetch
        live = pf.get("cache_hits", 0) / pf["cache_accesses"] if pf.get("cache_accesses") else None
        busy = s.busy_ms / 1e3 / max(1, d.tokens + s.result.prefill.tokens)
        gap = f"{100 * (hits - live):+.1f} points" if hits is not None and live else "n/a"
        io_gap = f"{100 * (io_pred / busy - 1):+.0f} %" if io_pred and busy else "n/a"
        lines.append(
            f"  t{s.threads} {s.config:<8} run: live-cache hit {live if live is None else round(live, 3)}, "
            f"page-cache hit {d.expert_hit_rate:.3f}, disk busy {1e3 * busy:.1f} ms/token | "
            f"replay: hit {hits if hits is None else round(hits, 3)} ({gap}), "
            f"I/O {1e3 * io_pred if io_pred else float('nan'):.1f} ms/token ({io_gap})"
        )  # fmt: skip
    return lines


def policy_check(model: Path, trace_path: Path, budget: int) -> list[str]:
    """Whether a hot set pinned from other prompts' routing beats plain LRU at the run's
    budget (the ``pinned-N`` policies: N % of each layer's slots hold the hottest experts of
    the training trace, the rest LRU), decode hit rates on the measured decode, cold start."""
    train_path = model.with_suffix(".moetrace")  # the plan's routing: other prompts
    with MoeModel(model) as m:
        trace = load_trace(trace_path, model=m)
        train = np.asarray(load_trace(train_path, model=m).ids)
        layout = ExpertRanges(m)
    blocks = layout.blocks
    slots = CacheBudget(bytes=budget).slots_per_layer(
        [layout.expert_bytes(b) for b in blocks], trace.k, [layout.n_expert[b] for b in blocks]
    )
    ids = np.asarray(trace.ids)
    decode = trace.phase_mask("decode")
    out = []
    for name in ("lru", "pinned-25", "pinned-50", "pinned-75", "belady"):
        policy = POLICIES.get(name)
        rates = None
        for layer, b in enumerate(blocks):
            learned = policy.fit(train[:, layer], layout.n_expert[b], slots[layer])
            hits = layer_hits(policy, ids[:, layer], slots[layer], layout.n_expert[b], learned)
            r = HitRates.of(hits, decode)
            rates = r if rates is None else rates + r
        assert rates is not None
        out.append(f"    {name:<10} decode hit rate {rates.decode:.3f}")
    return ["  hot sets pinned from other prompts vs LRU, same budget and decode:", *out]


def lookahead_check(model: Path, trace_path: Path, args: argparse.Namespace) -> list[str]:
    """The live lookahead's recall and precision in ``run`` against ``predict``'s on the same
    tokens: cross-layer, fitted on other prompts' routing, the budget of top-k."""
    train_path = model.with_suffix(".moetrace")
    words = args.prompt.split()
    opts = StreamOptions(lookahead="cross-layer", cache="kernel")
    # cold: the decode's experts were just read by the traced run; cached, the callback
    # turns itself off and nothing is predicted
    r = run_model(model, " ".join(words[:16]),
                  RunOptions(n_predict=args.tokens, n_ctx=256, threads=1, prefetch=opts,
                             lookahead_trace=str(train_path), cold=True),
                  continuation=" ".join(words[16:]))  # fmt: skip
    live = r.decode.to_json()
    with MoeModel(model) as m:
        trace = load_trace(trace_path, model=m)
        train = np.asarray(load_trace(train_path, model=m).ids)
    ids = np.asarray(trace.ids)
    fitted = fit("cross-layer", train, trace.n_expert)
    starts = np.zeros(ids.shape[0], dtype=bool)
    starts[0] = True
    pred = fitted.predict(ids, starts, trace.k)
    # the first layer has no earlier one to predict from: the run speculates from layer 2 on
    later = slice(1, None)
    got = overlap(pred[:, later], ids[:, later], trace.n_expert)
    recall = float(got.sum()) / (ids.shape[0] * (ids.shape[1] - 1) * trace.k)
    return [f"  lookahead cross-layer (fitted on other prompts): run recall {live['lookahead_recall'] or float('nan'):.3f} "
            f"precision {live['lookahead_precision'] or float('nan'):.3f} (decode, layers 2..); "
            f"predict on the same tokens: recall = precision {recall:.3f} (every layer after the first)"]  # fmt: skip


def random_check(args: argparse.Namespace) -> list[str]:
    """On routing with no structure a predictor can use, the lookahead must cost nothing:
    ``overlap`` (router lookahead) against ``overlap-nola``, alternated pairs, 1 thread."""
    model, _ = ensure_model(args.layers, args.dir, args.arch, planted=False,
                            weight_type=args.weight_type)  # fmt: skip
    files = {"overlap": model, "overlap-nola": model}
    got = measure("random", files, ["overlap", "overlap-nola"], args, thread_counts=[1])
    la = [s.result.decode.to_json() for s in got if s.config == "overlap"]
    ratios = [a.row()["tps"] / b.row()["tps"] for a, b in
              zip([s for s in got if s.config == "overlap"], [s for s in got if s.config == "overlap-nola"], strict=True)]  # fmt: skip
    return [f"  random routing, t1: lookahead on / off {statistics.median(ratios):.3f} (pairs "
            f"{', '.join(f'{r:.2f}' for r in ratios)}); its decode precision "
            f"{statistics.median((j['lookahead_precision'] or 0) for j in la):.3f}, recall "
            f"{statistics.median((j['lookahead_recall'] or 0) for j in la):.3f}"]  # fmt: skip


def stock_check(model: Path, label: str, args: argparse.Namespace) -> list[str]:
    """Stock llama.cpp with its defaults on a type they repack, under the holder: one cold run
    per thread count, each in a hold of its own (when the load's copy takes what is left, the
    holder lets go at its 1 GiB floor, or the kernel kills the run: both are the finding)."""
    out = []
    for threads in args.threads:
        with MemoryHold(parse_size(label), args.hold_floor) as hold:
            left = hold.available
            try:
                s = one_run("stock", model, args, threads, True, args.dir / "logits" / "s.npy")
            except Exception as e:  # a worker killed by the kernel is a MoepackError
                out.append(f"  {label} t{threads} stock (defaults), {left / GIB:.2f} GiB left: "
                           f"failed: {str(e)[:200]}")  # fmt: skip
                continue
            held = hold.alive()
        w = s.result.weights or {}
        anon = (w.get("anon_bytes_after_load") or 0) / GIB
        row = s.row()
        what = ("the holder stayed" if held else
                f"the holder let go (MemAvailable fell below its {args.hold_floor >> 20} MiB "
                "floor): on a machine "
                "with this little left and no swap, the kernel would have to kill")  # fmt: skip
        out.append(f"  {label} t{threads} stock (defaults), {left / GIB:.2f} GiB left: "
                   f"{len(w.get('repacked_experts', []))} expert tensors repacked, anonymous "
                   f"{anon:.2f} GiB after load; {what}; decode {row['tps']:.2f} tok/s "
                   f"{'(not under pressure)' if not held else ''}")  # fmt: skip
    return out


# -- 5. prefill ----------------------------------------------------------------------------


def prefill_check(
    model: Path, prompts: list[str], args: argparse.Namespace, probe: DiskProbe
) -> list[str]:
    """A 512-token prompt under pressure: stock against the prefetch, and the bound of reading
    the experts it touches at the probed bandwidth (captured routing says which)."""
    text = " ".join(prompts[:4])  # 4 x 128 planted tokens: a 512-token prompt
    out = []
    for threads in args.threads:
        rates: dict[str, list[float]] = {args.ref: [], "overlap": []}
        for i in range(args.prefill_pairs):
            for c in [args.ref, "overlap"] if i % 2 == 0 else ["overlap", args.ref]:
                drop_confirmed(model)
                r = run_model(model, text, RunOptions(n_predict=0, n_ctx=1024, batch=512, threads=threads,
                                                     **CONFIGS[c]))  # fmt: skip
                rates[c].append(r.prefill.tokens_per_second)
                n = r.prefill.tokens
        stock, ov = statistics.median(rates[args.ref]), statistics.median(rates["overlap"])
        with MoeModel(model) as m:
            touched = m.expert_bytes * (
                (n + 511) // 512
            )  # a 512-token ubatch touches every expert here
        bound = n / (touched / (probe.fetch_gbps * 1e9))
        out.append(f"  t{threads} prefill of {n} tokens: {args.ref} {stock:.2f} tok/s, prefetch {ov:.2f} "
                   f"({ov / stock:.2f}x); I/O bound {bound:.2f} tok/s ({ov / bound:.2f} of it)")  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/moepack-bench-run"))
    ap.add_argument("--small", action="store_true", help="an 8-layer model (0.9 GB)")
    ap.add_argument("--leave", default="1.5G", help="page-cache sizes held for, comma-separated")
    ap.add_argument(
        "--hold-floor", type=parse_size, default=GIB,
        help="the holder lets go below this MemAvailable (1G suits a shared machine; the "
        "live cache locks most of what is left, so on a machine of its own use 256M)",
    )  # fmt: skip
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", default=f"1,{os.cpu_count() or 1}", help="thread counts")
    ap.add_argument("--probe-rounds", type=int, default=3, help="disk probes of each kind")
    ap.add_argument(
        "--configs",
        default="stock,serial,overlap,overlap-nola,overlap-kernel,overlap-nopin,reordered",
        help=f"any of {', '.join(CONFIGS)} (fused ones need an architecture that takes them)",
    )
    ap.add_argument("--arch", default="qwen3moe", help="synthetic MoE family (moepack synth)")
    ap.add_argument("--prefill-pairs", type=int, default=1)
    ap.add_argument("--skip", default="", help="parts to skip: full,model,prefill,random")
    ap.add_argument(
        "--weight-type",
        choices=list(WEIGHT_TAGS),
        default="Q8_0",
        help="the model's type (Q4_K_M: llama.cpp repacks it at load by default)",
    )
    ap.add_argument("--layers", type=int, default=None,
                    help="default 8 with --small, else 32 (Q8_0) or 48 (Q4_K_M: about as much "
                    "larger than what is left)")  # fmt: skip
    args = ap.parse_args()
    if args.layers is None:
        args.layers = 8 if args.small else (32 if args.weight_type == "Q8_0" else 48)
    # the bit-exact reference: llama.cpp's defaults, but for a type they repack at load (the
    # repacked kernels sum in another order; stock then runs on its own, see stock_check)
    args.ref = "stock" if args.weight_type == "Q8_0" else "stock-mapped"
    args.threads = sorted({int(t) for t in args.threads.split(",")})
    skip = set(filter(None, args.skip.split(",")))
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration {unknown[0]!r}; known: {', '.join(CONFIGS)}")
    if any("fused" in c for c in configs) and not takes_fused_gate_up(args.arch):
        ap.error(f"llama.cpp does not load a fused gate+up for {args.arch!r}")
    for c in ("stock", args.ref):
        if c not in configs:
            configs.insert(0, c)
    args.dir.mkdir(parents=True, exist_ok=True)
    model, prompts = ensure_model(args.layers, args.dir, args.arch,
                                  weight_type=args.weight_type)  # fmt: skip
    args.prompt, args.prompts = prompts[0], prompts
    files = {c: model for c in configs}
    for c in configs:
        layout = REWRITES.get(c)
        if layout is not None:
            files[c] = ensure_rewrite(model, layout, prompts, 1)
    size = model.stat().st_size
    with MoeModel(model) as m:
        expert_share = m.expert_bytes / size
    print(f"model {model.name}: {size / 1e9:.2f} GB ({100 * expert_share:.0f} % experts), "
          f"read_ahead_kb {read_ahead_kb(model)}, MemAvailable {mem_available() / GIB:.1f} GiB, "
          f"threads {args.threads}, {args.tokens} tokens, {args.pairs} alternated pairs, "
          f"load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    probe = probe_disk(model, args.probe_rounds)
    print(f"disk, cold, every slice once: fio buffered randread {probe.slice_bytes // 1024} KiB x 8 readers "
          f"{probe.fio_gbps:.2f} GB/s; prefetcher read-ahead ({probe.fetcher}) 24 slices at a "
          f"time {probe.fetch_gbps:.2f} GB/s ({probe.ratio:.2f} of fio)", flush=True)  # fmt: skip
    full: list[Sample] = []
    if "full" not in skip:
        full = measure("full", files, configs, args)
    compute = compute_seconds(full)
    lines = table("full", full, probe, compute, args.ref) if full else []
    # under pressure stock's defaults copy a repacked type into memory: run apart (stock_check)
    squeezed = [c for c in configs if c != "stock" or args.ref == "stock"]
    pressure: list[Sample] = []
    by_label: dict[str, tuple[list[Sample], bool]] = {}  # the table's runs, and if they held
    checks: list[str] = []
    for label in args.leave.split(","):
        with MemoryHold(parse_size(label), args.hold_floor) as hold:
            print(f"holding {hold.held / GIB:.1f} GiB, {hold.available / GIB:.2f} GiB left "
                  f"(model {size / GIB:.2f} GiB)", flush=True)  # fmt: skip
            got = measure(label, files, squeezed, args)
            held = hold.alive()
            if "model" not in skip:
                checks += model_check(model, args, [s for s in got if s.config == "overlap"][:2])
            if "prefill" not in skip:
                checks += prefill_check(model, prompts, args, probe)
            if "random" not in skip:
                checks += random_check(args)
            if not held:
                print(f"  {label}: the holder let go during the table's runs: not valid")
            elif not hold.alive():
                print(f"  {label}: the holder let go after the table's runs, in the checks "
                      f"(MemAvailable < {args.hold_floor >> 20} MiB): the checks are not "
                      "valid")  # fmt: skip
        pressure += got
        by_label[label] = (got, held)
        lines += table(label, got, probe, compute, args.ref)
        if args.ref != "stock":
            checks += stock_check(model, label, args)
    print()
    print(HEADER)
    for line in lines:
        print(line)
    print()
    for line in checks:
        print(line)
    record_headlines(args, size, probe, full, by_label, compute)
    return 0


def pair_ratio(samples: list[Sample], config: str, ref: str, threads: int) -> float | None:
    """``config``'s tok/s over ``ref``'s, the median of the pairs' ratios (as ``table``)."""
    ss = [s for s in samples if s.config == config and s.threads == threads]
    base = [s for s in samples if s.config == ref and s.threads == threads]
    if not ss or not base:
        return None
    return statistics.median(
        a.row()["tps"] / b.row()["tps"] for a, b in zip(ss, base, strict=False)
    )


def record_headlines(
    args: argparse.Namespace,
    size: int,
    probe: DiskProbe,
    full: list[Sample],
    by_label: dict[str, tuple[list[Sample], bool]],
    compute: dict[tuple[str, int], float],
) -> None:
    """The default ``--prefetch`` (``overlap``) against the reference at the fewest threads,
    under the first ``--leave`` (when the holder held) and fully cached, and the prefetcher's
    reads against fio, as benchmarks/README.md's table shows them."""
    t = min(args.threads)
    variant = "" if args.weight_type == "Q8_0" else f", {args.weight_type}"
    variant += "" if args.arch == "qwen3moe" else f", {args.arch}"
    key = variant.replace(", ", "-").replace("_", "").lower()
    model = (
        f"synthetic {args.arch}, {args.layers} layers × 64 experts, top-8, "
        f"{args.weight_type}, planted routing, {size / 1e9:.2f} GB"
    )
    ref = "stock llama.cpp" if args.ref == "stock" else "llama.cpp with the experts mapped"
    threads = f"{t} thread{'s' if t > 1 else ''}"
    record(
        "prefetch-reads",
        title="Prefetcher reads against fio",
        what="the read-ahead thread's cold random reads of every expert slice, 24 at a time",
        ratio=probe.ratio,
        yardstick="fio's buffered random reads of one slice, 8 readers",
        yardstick_value=probe.fio_gbps,
        unit="GB/s",
        figures={
            "prefetcher GB/s": probe.fetch_gbps,
            "fio GB/s": probe.fio_gbps,
            "slice KiB": probe.slice_bytes // 1024,
            "rounds": args.probe_rounds,
        },
        target="≥ 0.9 of fio (issue 19)",
        met=probe.ratio >= 0.9,
        model=f"{model}, {probe.slice_bytes // 1024} KiB slices",
    )
    label = args.leave.split(",")[0]
    got, held = by_label[label]
    ratio = pair_ratio(got, "overlap", args.ref, t)
    if ratio is not None and held:
        rows = [s.row() for s in got if s.config == "overlap" and s.threads == t]
        base = [s.row() for s in got if s.config == args.ref and s.threads == t]
        tps = statistics.median(r["tps"] for r in rows)
        io = statistics.median(r["mb_read"] for r in rows) * 1e6 / (probe.fetch_gbps * 1e9)
        comp = compute.get((args.ref, t))
        bound = tps * max(io, comp) if comp else None  # the share of 1 / max(io, compute)
        more = {f"{n} threads": pair_ratio(got, "overlap", args.ref, n) for n in args.threads[1:]}
        record(
            f"prefetch-pressure{key}",
            title=f"`run --prefetch` under memory pressure{variant}",
            what=f"decode tok/s, {label} of page cache left for a {size / 2**30:.2f} GiB model, "
            f"{threads}",
            ratio=ratio,
            yardstick=ref,
            yardstick_value=statistics.median(r["tps"] for r in base),
            unit="tok/s",
            figures={
                "prefetch tok/s": tps,
                "prefetch MB/token": statistics.median(r["mb_read"] for r in rows),
                f"{args.ref} MB/token": statistics.median(r["mb_read"] for r in base),
                "of the overlapped bound": bound,
                "pairs": args.pairs,
            }
            | more,
            target="≥ 8× stock (issue 19)" if not variant else None,
            met=ratio >= 8 if not variant else None,
            detail="; ".join(f"{n} {r:.2f}×" for n, r in more.items() if r is not None)
            + (f"; {bound:.2f} of the overlapped bound" if bound else "")
            + (
                "; logits bit-identical"
                if all(s.identical for s in got if s.config == "overlap")
                else "; logits NOT bit-identical"
            ),
            model=model,
        )
    ratio = pair_ratio(full, "overlap", args.ref, t)
    if ratio is not None:
        base_tps = statistics.median(
            s.row()["tps"] for s in full if s.config == args.ref and s.threads == t
        )
        more = {f"{n} threads": pair_ratio(full, "overlap", args.ref, n) for n in args.threads[1:]}
        record(
            f"prefetch-cached{key}",
            title=f"`run --prefetch` with the model fully cached{variant}",
            what=f"decode tok/s of the default `--prefetch`, {threads}",
            ratio=ratio,
            yardstick=ref,
            yardstick_value=base_tps,
            unit="tok/s",
            figures={"pairs": args.pairs} | more,
            target="≥ 0.97× stock (issues 19, 26)",
            met=ratio >= 0.97,
            detail="; ".join(f"{n} {r:.2f}×" for n, r in more.items() if r is not None) or None,
            model=f"{model}, warm",
        )


if __name__ == "__main__":
    from moepack.safeio import replacing

    with replacing():  # a benchmark's scratch files are its own, replaced run after run
        sys.exit(main())
